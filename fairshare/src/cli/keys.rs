//! The keys file of `fairshare serve`: API keys and the caller each one stands for.
//!
//! ```toml
//! [keys."sk-acme"]
//! tenant = "acme"
//! instance = "shared-agent"
//! tier = "internal"
//! ```

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use serde::Deserialize;
use tower_fairshare::policy::plain_words;
use tower_fairshare::{Caller, Policy};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawKeys {
    keys: BTreeMap<String, RawKey>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawKey {
    tenant: Option<String>,
    instance: Option<String>,
    tier: Option<String>,
    /// The caller's plan (an unlisted tenant's template).
    #[serde(default)]
    plan: Option<String>,
}

/// A keys file that cannot be used, and why.
#[derive(Debug, thiserror::Error)]
pub(crate) enum KeysError {
    #[error("cannot read keys file `{path}`: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: {message}")]
    Invalid { path: String, message: String },
}

/// API key → caller, as the demo auth layer looks them up.
#[derive(Clone, Debug, Default)]
pub(crate) struct Keys {
    callers: HashMap<String, Caller>,
}

impl Keys {
    /// Parses a keys file. Unknown fields, empty names and keys that name neither a tenant nor
    /// an instance are errors naming the offending field (`keys."sk-acme".tenant`).
    pub(crate) fn from_toml_str(text: &str) -> Result<Keys, KeysError> {
        let de = toml::Deserializer::parse(text).map_err(|e| KeysError::Invalid {
            path: "keys file".into(),
            message: e.to_string().trim().to_owned(),
        })?;
        let raw: RawKeys = serde_path_to_error::deserialize(de).map_err(|e| {
            let path = e.path().to_string();
            KeysError::Invalid {
                path: if path == "." {
                    "keys file".into()
                } else {
                    path
                },
                message: plain_words(e.inner().message().trim()),
            }
        })?;
        if raw.keys.is_empty() {
            return Err(KeysError::Invalid {
                path: "keys".into(),
                message: "no keys: add at least one `[keys.\"<api key>\"]` table with a tenant"
                    .into(),
            });
        }
        let mut callers = HashMap::with_capacity(raw.keys.len());
        for (key, k) in raw.keys {
            let at = |field: &str| format!("keys.{key:?}{field}");
            if key.trim().is_empty() {
                return Err(KeysError::Invalid {
                    path: at(""),
                    message: "an API key cannot be empty".into(),
                });
            }
            for (field, value) in [
                (".tenant", &k.tenant),
                (".instance", &k.instance),
                (".tier", &k.tier),
                (".plan", &k.plan),
            ] {
                if value.as_deref().is_some_and(|v| v.trim().is_empty()) {
                    return Err(KeysError::Invalid {
                        path: at(field),
                        message: "cannot be empty: remove the field or give it a name".into(),
                    });
                }
            }
            let mut caller = match (&k.tenant, &k.instance) {
                (Some(t), _) => Caller::new(t.as_str()),
                (None, Some(_)) => Caller::untenanted(),
                (None, None) => {
                    return Err(KeysError::Invalid {
                        path: at(""),
                        message: "names neither a tenant nor an instance: add `tenant = \"...\"` \
                                  (or `instance` for an untenanted client)"
                            .into(),
                    })
                }
            };
            if let Some(i) = k.instance {
                caller = caller.with_instance(i);
            }
            if let Some(t) = k.tier {
                caller = caller.with_tier(t);
            }
            if let Some(p) = k.plan {
                caller = caller.with_plan(p);
            }
            callers.insert(key, caller);
        }
        Ok(Keys { callers })
    }

    /// Reads a keys file.
    pub(crate) fn from_path(path: &Path) -> Result<Keys, KeysError> {
        let text = std::fs::read_to_string(path).map_err(|source| KeysError::Io {
            path: path.display().to_string(),
            source,
        })?;
        Keys::from_toml_str(&text).map_err(|e| match e {
            KeysError::Invalid { path: p, message } => KeysError::Invalid {
                path: format!("{}: {p}", path.display()),
                message,
            },
            other => other,
        })
    }

    /// The caller an API key stands for.
    pub(crate) fn caller(&self, key: &str) -> Option<&Caller> {
        self.callers.get(key)
    }

    /// How many keys there are.
    pub(crate) fn len(&self) -> usize {
        self.callers.len()
    }

    /// Keys whose tenant no tool of `policy` admits (not listed, no `default_tenant`): every
    /// call with them will be refused.
    pub(crate) fn warnings(&self, policy: &Policy) -> Vec<String> {
        let mut out: Vec<String> = self
            .callers
            .iter()
            .filter_map(|(key, caller)| {
                let tenant = caller.tenant()?;
                let known = policy.tools().any(|t| t.tenant(tenant).is_some());
                (!known).then(|| {
                    format!(
                        "key {key:?}: no tool lists tenant {tenant:?} or has a default_tenant, \
                         so its calls will be refused (403)"
                    )
                })
            })
            .collect();
        out.sort();
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_tenant_instance_and_tier() {
        let keys = Keys::from_toml_str(
            r#"
            [keys."sk-acme"]
            tenant = "acme"
            instance = "shared-agent"
            tier = "internal"
            [keys."sk-client"]
            instance = "client-7"
            "#,
        )
        .unwrap();
        let acme = keys.caller("sk-acme").unwrap();
        assert_eq!(acme.tenant(), Some("acme"));
        assert_eq!(acme.instance(), Some("shared-agent"));
        assert_eq!(acme.tier(), Some("internal"));
        let client = keys.caller("sk-client").unwrap();
        assert_eq!(client.tenant(), None);
        assert_eq!(client.instance(), Some("client-7"));
        assert!(keys.caller("sk-nobody").is_none());
    }

    #[test]
    fn errors_name_the_field() {
        let err = |text: &str| Keys::from_toml_str(text).unwrap_err().to_string();
        let typo = err("[keys.\"sk-a\"]\ntenant = \"a\"\ntenat = \"b\"\n");
        assert!(
            typo.contains("keys.sk-a") && typo.contains("tenat"),
            "{typo}"
        );
        let empty = err("[keys.\"sk-a\"]\ntenant = \"\"\n");
        assert!(empty.contains("keys.\"sk-a\".tenant"), "{empty}");
        let anonymous = err("[keys.\"sk-a\"]\ntier = \"internal\"\n");
        assert!(anonymous.contains("neither a tenant"), "{anonymous}");
        let none = err("keys = {}\n");
        assert!(none.contains("no keys"), "{none}");
        let top = err("[key.\"sk-a\"]\ntenant = \"a\"\n");
        assert!(top.contains("key"), "{top}");
        let wrong_type = err("[keys.\"sk-a\"]\ntenant = 3\n");
        assert!(wrong_type.contains("keys.sk-a.tenant"), "{wrong_type}");
    }
}
