//! Store keys, built in one place.
//!
//! Every key is `fs5{<tool>}<kind><parts>` (for a tool in a group
//! `fs5{<group>}g<tool><kind><parts>`) where each name is length-prefixed
//! (`<byte length>:<bytes>`). Length prefixes make the encoding uniquely decodable, so no two
//! distinct (tool, tenant, instance) triples share a key whatever bytes they contain (`:`,
//! `|`, `{`, `}`, unicode). The kind byte keeps tool, tenant, instance and untenanted keys
//! in disjoint spaces. The `{...}` hash tag holds only the tool (or its group): every key one
//! decision touches is in one Redis Cluster slot, so a decision stays one atomic script.

mod name;
pub use name::Name;

/// What a key names.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub(crate) enum KeyKind {
    /// The tool's own state (shared pool, window, template tenants counted).
    Tool,
    /// A tenant of a tool.
    Tenant,
    /// An instance of a tenant.
    Instance,
    /// A caller without a tenant (only when the tool has `require_tenant = false`).
    Untenanted,
}

impl KeyKind {
    fn byte(self) -> char {
        match self {
            KeyKind::Tool => 'T',
            KeyKind::Tenant => 't',
            KeyKind::Instance => 'i',
            KeyKind::Untenanted => 'u',
        }
    }
}

/// The version prefix: bump it when the state layout changes so old keys are never misread.
pub(crate) const KEY_PREFIX: &str = "fs5";

fn push_part(out: &mut String, part: &str) {
    out.push_str(itoa::Buffer::new().format(part.len()));
    out.push(':');
    out.push_str(part);
}

/// The tool a key is of: its name, and its group when it is in one not named after it.
#[derive(Copy, Clone, Debug)]
pub(crate) struct Tool<'a> {
    pub(crate) name: &'a str,
    pub(crate) group: Option<&'a str>,
}

#[cfg_attr(not(feature = "redis"), allow(dead_code))]
/// The key of a lone tool's own state (of a group's: the key its state would have as a tool
/// of that name, which names the group's markers).
pub(crate) fn tool_key(tool: &str) -> String {
    encode(
        Tool {
            name: tool,
            group: None,
        },
        KeyKind::Tool,
        &[],
    )
}

/// `fs5{<tool>}<kind><parts>`, or for a tool in a group `fs5{<group>}g<tool><kind><parts>`:
/// the hash tag is what a store keeps together (one Redis Cluster slot).
pub(crate) fn encode(tool: Tool<'_>, kind: KeyKind, parts: &[&str]) -> String {
    let len = 10 + tool.name.len() + tool.group.map_or(0, |g| g.len() + 6);
    let mut out = String::with_capacity(len + parts.iter().map(|p| p.len() + 6).sum::<usize>());
    out.push_str(KEY_PREFIX);
    out.push('{');
    match tool.group {
        Some(group) => {
            push_part(&mut out, group);
            out.push_str("}g");
            push_part(&mut out, tool.name);
        }
        None => {
            push_part(&mut out, tool.name);
            out.push('}');
        }
    }
    out.push(kind.byte());
    for p in parts {
        push_part(&mut out, p);
    }
    out
}

/// Decodes a key built by this module: (tool, kind, parts). `None` if it is not one.
#[cfg(test)]
pub(crate) fn decode(key: &str) -> Option<(String, KeyKind, Vec<String>)> {
    let rest = key.strip_prefix(KEY_PREFIX)?.strip_prefix('{')?;
    let (tag, rest) = take_part(rest)?;
    let rest = rest.strip_prefix('}')?;
    let (tool, rest) = match rest.strip_prefix('g') {
        Some(rest) => take_part(rest)?,
        None => (tag, rest),
    };
    let mut chars = rest.chars();
    let kind = match chars.next()? {
        'T' => KeyKind::Tool,
        't' => KeyKind::Tenant,
        'i' => KeyKind::Instance,
        'u' => KeyKind::Untenanted,
        _ => return None,
    };
    let mut rest = chars.as_str();
    let mut parts = Vec::new();
    while !rest.is_empty() {
        let (p, r) = take_part(rest)?;
        parts.push(p.to_owned());
        rest = r;
    }
    let expected = match kind {
        KeyKind::Tool => 0,
        KeyKind::Tenant | KeyKind::Untenanted => 1,
        KeyKind::Instance => 2,
    };
    (parts.len() == expected).then(|| (tool.to_owned(), kind, parts))
}

#[cfg(test)]
fn take_part(s: &str) -> Option<(&str, &str)> {
    let colon = s.find(':')?;
    let len: usize = s[..colon].parse().ok()?;
    let body = s.get(colon + 1..colon + 1 + len)?;
    Some((body, &s[colon + 1 + len..]))
}

/// The Redis Cluster hash tag of a key: the bytes between the first `{` and the next `}`.
#[cfg_attr(not(feature = "redis"), allow(dead_code))]
pub(crate) fn hash_tag(key: &str) -> &str {
    if let Some(open) = key.find('{') {
        if let Some(close) = key[open + 1..].find('}') {
            if close > 0 {
                return &key[open + 1..open + 1 + close];
            }
        }
    }
    key
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn instance_key(tool: &str, tenant: &str, instance: &str) -> String {
        encode(
            Tool {
                name: tool,
                group: None,
            },
            KeyKind::Instance,
            &[tenant, instance],
        )
    }
    fn tenant_key(tool: &str, tenant: &str) -> String {
        encode(
            Tool {
                name: tool,
                group: None,
            },
            KeyKind::Tenant,
            &[tenant],
        )
    }
    fn untenanted_key(tool: &str, instance: &str) -> String {
        encode(
            Tool {
                name: tool,
                group: None,
            },
            KeyKind::Untenanted,
            &[instance],
        )
    }

    #[test]
    fn a_group_keeps_its_tools_keys_together_and_apart() {
        let grouped = |name| Tool {
            name,
            group: Some("chat"),
        };
        let a = encode(grouped("chat.tokens"), KeyKind::Tenant, &["acme"]);
        let b = encode(grouped("chat.requests"), KeyKind::Tenant, &["acme"]);
        assert_ne!(a, b);
        assert_eq!(hash_tag(&a), hash_tag(&b));
        assert_eq!(hash_tag(&a), hash_tag(&tool_key("chat")));
        assert_eq!(
            decode(&a),
            Some(("chat.tokens".into(), KeyKind::Tenant, vec!["acme".into()]))
        );
        // A lone tool named like a group's tool never shares its keys.
        assert_ne!(a, tenant_key("chat.tokens", "acme"));
    }

    #[test]
    fn colon_in_names_does_not_collide() {
        assert_ne!(
            instance_key("t", "org", "acme:report"),
            instance_key("t", "org:acme", "report")
        );
        assert_ne!(tenant_key("t", "a"), untenanted_key("t", "a"));
    }

    proptest! {
        #[test]
        fn keys_are_injective_and_decodable(
            tool in ".{1,12}", tenant in ".{0,12}", instance in ".{0,12}",
            tool2 in ".{1,12}", tenant2 in ".{0,12}", instance2 in ".{0,12}",
        ) {
            let a = instance_key(&tool, &tenant, &instance);
            let b = instance_key(&tool2, &tenant2, &instance2);
            prop_assert_eq!(a == b, (&tool, &tenant, &instance) == (&tool2, &tenant2, &instance2));
            prop_assert_eq!(decode(&a), Some((tool.clone(), KeyKind::Instance, vec![tenant.clone(), instance.clone()])));
            // Every key of one tool shares its hash tag, whatever the names contain.
            let tag = hash_tag(&a).to_owned();
            for other in [tool_key(&tool), tenant_key(&tool, &tenant), untenanted_key(&tool, &instance)] {
                prop_assert_eq!(hash_tag(&other), tag.as_str());
            }
            // Tenanted and untenanted spaces never meet.
            prop_assert_ne!(tenant_key(&tool, &tenant), untenanted_key(&tool2, &tenant2));
            prop_assert_ne!(tenant_key(&tool, &tenant), instance_key(&tool2, &tenant2, &instance2));
        }
    }
}
