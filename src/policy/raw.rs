//! The policy file as written: serde types, before validation.
//!
//! These mirror the TOML/JSON structure exactly (`deny_unknown_fields` everywhere) and are
//! turned into checked types by `validate.rs`. The builder API writes the same types, so one
//! validator serves files and code.

use serde::de::{Deserializer, MapAccess, Visitor};
use serde::{Deserialize, Serialize};
use std::fmt;

use super::{BudgetPeriod, OnStoreError, Unit, UnknownPlan};

/// A map that keeps file order and refuses duplicate names (JSON objects would silently keep
/// the last one otherwise).
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub(crate) struct UniqueMap<T>(pub(crate) Vec<(String, T)>);

impl<T> UniqueMap<T> {
    pub(crate) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl<'de, T: Deserialize<'de>> Deserialize<'de> for UniqueMap<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<T>(std::marker::PhantomData<T>);
        impl<'de, T: Deserialize<'de>> Visitor<'de> for V<T> {
            type Value = UniqueMap<T>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a table of names")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                let mut out: Vec<(String, T)> = Vec::with_capacity(map.size_hint().unwrap_or(0));
                // A set of the names so far: a policy may list hundreds of thousands of
                // tenants, and each must be checked against all before it.
                let mut seen: std::collections::HashSet<String, foldhash::fast::RandomState> =
                    std::collections::HashSet::with_capacity_and_hasher(
                        out.capacity(),
                        Default::default(),
                    );
                while let Some(k) = map.next_key::<String>()? {
                    if !seen.insert(k.clone()) {
                        return Err(serde::de::Error::custom(format!(
                            "duplicate name `{k}`: each name may appear once"
                        )));
                    }
                    let v = map.next_value()?;
                    out.push((k, v));
                }
                Ok(UniqueMap(out))
            }
        }
        d.deserialize_map(V(std::marker::PhantomData))
    }
}

#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawPolicy {
    #[serde(default)]
    pub(crate) tool: Vec<RawTool>,
}

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawRate {
    pub(crate) limit: f64,
    pub(crate) per: String,
}

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawBudget {
    pub(crate) period: BudgetPeriod,
    pub(crate) max: f64,
}

/// What a caller without a `ceiling` of its own may take per period.
#[derive(Copy, Clone, Debug, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub(crate) enum DefaultCeiling {
    /// Its nominal allocation, floor + share (the default).
    Nominal,
    /// Everything not reserved for others: its floor + the whole spare (work-conserving).
    Capacity,
}

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawTool {
    pub(crate) name: String,
    /// Tools charged together by one call share a group (see `ToolPolicy::group`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) group: Option<String>,
    pub(crate) unit: Unit,
    pub(crate) rate: RawRate,
    #[serde(default)]
    pub(crate) burst: Option<f64>,
    #[serde(default)]
    pub(crate) tier: Option<String>,
    #[serde(default)]
    pub(crate) tiers: Option<Vec<String>>,
    #[serde(default)]
    pub(crate) require_tenant: Option<bool>,
    #[serde(default)]
    pub(crate) max_concurrency: Option<f64>,
    #[serde(default)]
    pub(crate) budgets: Vec<RawBudget>,
    #[serde(default)]
    pub(crate) enforce: Option<bool>,
    #[serde(default)]
    pub(crate) on_store_error: Option<OnStoreError>,
    #[serde(default)]
    pub(crate) default_ceiling: Option<DefaultCeiling>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) lease: Option<RawLease>,
    #[serde(default)]
    pub(crate) default_tenant: Option<RawLevel>,
    /// Templates for unlisted tenants by the plan their caller carries.
    #[serde(default, skip_serializing_if = "UniqueMap::is_empty")]
    pub(crate) plans: UniqueMap<RawLevel>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) unknown_plan: Option<UnknownPlan>,
    #[serde(default)]
    pub(crate) tenants: UniqueMap<RawLevel>,
}

/// A tool's `lease` setting as written: `"auto"`, `"off"`, or `{ max = N }`.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum RawLease {
    /// A word: only `"auto"` and `"off"` are valid (checked in validation, which names the
    /// path).
    Word(String),
    /// The largest grant, in the tool's units.
    Max(f64),
}

impl Serialize for RawLease {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        match self {
            RawLease::Word(w) => s.serialize_str(w),
            RawLease::Max(m) => {
                let mut map = s.serialize_map(Some(1))?;
                map.serialize_entry("max", m)?;
                map.end()
            }
        }
    }
}

impl<'de> Deserialize<'de> for RawLease {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = RawLease;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("\"auto\", \"off\" or a table `{ max = N }`")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<RawLease, E> {
                Ok(RawLease::Word(v.to_owned()))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<RawLease, A::Error> {
                let mut max = None;
                while let Some(k) = map.next_key::<String>()? {
                    if k != "max" {
                        return Err(serde::de::Error::custom(format!(
                            "unknown field `{k}` in `lease`: the only field is `max`"
                        )));
                    }
                    max = Some(map.next_value::<f64>()?);
                }
                max.map(RawLease::Max).ok_or_else(|| {
                    serde::de::Error::custom("`lease` needs `max`, e.g. `lease = { max = 64 }`")
                })
            }
        }
        d.deserialize_any(V)
    }
}

/// A tenant or an instance (listed, or a template). The fields of one kind only are
/// reported where they are misplaced by validation, naming where they belong.
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawLevel {
    #[serde(default)]
    pub(crate) weight: Option<f64>,
    #[serde(default)]
    pub(crate) floor: Option<f64>,
    #[serde(default)]
    pub(crate) ceiling: Option<f64>,
    #[serde(default)]
    pub(crate) burst: Option<f64>,
    #[serde(default)]
    pub(crate) max_concurrency: Option<f64>,
    #[serde(default)]
    pub(crate) budgets: Vec<RawBudget>,
    /// Only in `default_tenant` and plans.
    #[serde(default)]
    pub(crate) max_tenants: Option<f64>,
    /// Only in `default_instance`.
    #[serde(default)]
    pub(crate) max_instances: Option<f64>,
    /// Only in a tenant.
    #[serde(default)]
    pub(crate) default_instance: Option<Box<RawLevel>>,
    /// Only in a tenant.
    #[serde(default)]
    pub(crate) instances: UniqueMap<RawLevel>,
}
