//! The keys one call touches: its levels' records (built in `crate::key`), behind the store's
//! namespace, and beyond them its permits, the epoch markers and the turn.

use crate::admission::engine::Charge;
use crate::store::CallKeys;

/// The record keys of a call's levels (tool, tenant, instance), behind the store's namespace.
pub(super) fn state_keys(namespace: &str, keys: &CallKeys) -> [Option<String>; 3] {
    let mut encoded = keys.encoded();
    if !namespace.is_empty() {
        for k in encoded.iter_mut().flatten() {
            k.insert_str(0, namespace);
        }
    }
    encoded
}

/// The key of a level's concurrency permits: its state key and `!`. Never a key
/// [`crate::key`] builds (a complete key followed by a byte that cannot start a part), so the
/// spaces never meet, and it keeps the tool's hash tag.
pub(super) fn permits_key(state_key: &str) -> String {
    suffixed(state_key, '!')
}

/// How long a tool's epoch marker outlives the last read or check that saw it: longer than any
/// record of the tool can live (a month's budget), so a marker that is missing means its
/// records are gone too — lost, or never written.
pub(super) const MARKER_TTL: std::time::Duration = std::time::Duration::from_secs(32 * 86_400);

/// The key of a tool's epoch marker: its state key and `@` (see [`permits_key`]).
pub(super) fn epoch_key(tool_key: &str) -> String {
    suffixed(tool_key, '@')
}

/// The key of a tool's turn: which replica may write the tool's records next after another
/// replica's write got in first (see the batch script), its state key and `%`.
pub(super) fn turn_key(tool_key: &str) -> String {
    suffixed(tool_key, '%')
}

fn suffixed(key: &str, mark: char) -> String {
    let mut k = String::with_capacity(key.len() + 1);
    k.push_str(key);
    k.push(mark);
    k
}

/// Among a call's `state` keys (see [`state_keys`]), those of the levels where `charge` took a
/// permit.
pub(super) fn permitted<'a>(
    state: &'a [Option<String>; 3],
    charge: &'a Charge,
) -> impl Iterator<Item = &'a String> {
    state
        .iter()
        .zip(&charge.levels)
        .filter(|(_, level)| level.permit)
        .filter_map(|(key, _)| key.as_ref())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn suffixed_keys_stay_in_the_tools_slot_and_never_meet() {
        let tool = crate::key::tool_key("t");
        let tag = crate::key::hash_tag(&tool).to_owned();
        let keys = [permits_key(&tool), epoch_key(&tool), tool.clone()];
        for k in &keys {
            assert_eq!(crate::key::hash_tag(k), tag, "{k}");
            assert!(crate::key::decode(k).is_none() || *k == tool, "{k}");
        }
        let mut sorted = keys.to_vec();
        sorted.sort();
        sorted.dedup();
        assert_eq!(sorted.len(), keys.len());
    }
}
