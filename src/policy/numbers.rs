//! The per-period numbers a level is owed, from its policy and its siblings' weights. One
//! function serves the allocation table and every decision, so they always agree.

use super::validate::share_of;
use super::LevelPolicy;

/// What a tenant or instance is owed per period, given the spare capacity of its parent and
/// the weight of the siblings active now.
#[derive(Copy, Clone, Debug, Default, PartialEq)]
pub(crate) struct LevelNumbers {
    pub(crate) weight: f64,
    /// Floor as written.
    pub(crate) floor: f64,
    /// Rate of the level's private floor bucket: its reserved floor less what its own
    /// children reserve.
    pub(crate) own_floor: f64,
    /// Nominal share of the parent's spare capacity.
    pub(crate) share: f64,
    /// Ceiling per period (explicit, or floor + share).
    pub(crate) ceiling: f64,
    /// Rate of the share bucket: floor + share − reserved floor.
    pub(crate) share_rate: f64,
    /// Rate of the ceiling bucket, and the non-floor cap per window: ceiling − reserved floor.
    pub(crate) ceiling_rate: f64,
}

pub(crate) fn level_numbers(p: &LevelPolicy, spare: f64, total_weight: f64) -> LevelNumbers {
    let share = share_of(spare, p.weight, total_weight);
    let nominal = p.floor + share;
    let ceiling = p.ceiling.unwrap_or(nominal);
    let reserved = p.reserved_floor;
    LevelNumbers {
        weight: p.weight,
        floor: p.floor,
        own_floor: (reserved - p.children_floor).max(0.0),
        share,
        ceiling,
        share_rate: (nominal - reserved).max(0.0),
        ceiling_rate: (ceiling - reserved).max(0.0),
    }
}

/// An instance's numbers under tenant `t` (numbers `tn`) with `n` of `t`'s template
/// instances counted.
pub(crate) fn instance_numbers(
    t: &LevelPolicy,
    tn: LevelNumbers,
    i: &LevelPolicy,
    n: f64,
) -> LevelNumbers {
    let inner_spare = (tn.ceiling - t.children_floor).max(0.0);
    let template_weight = t.default_child.as_ref().map_or(0.0, |d| d.weight);
    let inner_weight = t.configured_child_weight + template_weight * n;
    level_numbers(i, inner_spare, inner_weight)
}
