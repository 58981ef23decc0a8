//! A level's name as a call's keys hold it.

use std::fmt;
use std::hash::{Hash, Hasher};
use std::sync::Arc;

/// The longest name held inline.
const INLINE: usize = 22;

/// A tool's, tenant's or instance's name as a call's [keys](crate::store::CallKeys) hold it.
/// A name of up to 22 bytes (most names) is held inline, so an answer that carries its call's
/// keys copies them and shares nothing with the caller; a longer one is shared. Reads as a
/// `&str`; equal, ordered and hashed as its text.
///
/// ```
/// use tower_fairshare::store::Name;
///
/// let name = Name::from("acme");
/// assert_eq!(&*name, "acme");
/// assert_eq!(name, Name::from(String::from("acme")));
/// ```
#[derive(Clone)]
pub struct Name(Repr);

#[derive(Clone)]
enum Repr {
    Inline { len: u8, bytes: [u8; INLINE] },
    Shared(Arc<str>),
}

impl Name {
    /// The name as text.
    pub fn as_str(&self) -> &str {
        match &self.0 {
            // Written from a `&str` (see `From<&str>`), so it is UTF-8.
            Repr::Inline { .. } => std::str::from_utf8(self.as_bytes()).unwrap_or_default(),
            Repr::Shared(s) => s,
        }
    }

    /// The name's bytes, read without checking them again.
    pub fn as_bytes(&self) -> &[u8] {
        match &self.0 {
            Repr::Inline { len, bytes } => &bytes[..usize::from(*len)],
            Repr::Shared(s) => s.as_bytes(),
        }
    }
}

impl From<&str> for Name {
    fn from(s: &str) -> Self {
        inline(s).unwrap_or_else(|| Name(Repr::Shared(Arc::from(s))))
    }
}

impl From<&Arc<str>> for Name {
    /// Copied when short enough to hold inline, shared otherwise.
    fn from(s: &Arc<str>) -> Self {
        inline(s).unwrap_or_else(|| Name(Repr::Shared(s.clone())))
    }
}

impl From<Arc<str>> for Name {
    fn from(s: Arc<str>) -> Self {
        Name::from(&s)
    }
}

impl From<String> for Name {
    fn from(s: String) -> Self {
        Name::from(s.as_str())
    }
}

/// `s` held inline, when it fits.
fn inline(s: &str) -> Option<Name> {
    let mut bytes = [0; INLINE];
    bytes.get_mut(..s.len())?.copy_from_slice(s.as_bytes());
    Some(Name(Repr::Inline {
        len: s.len() as u8,
        bytes,
    }))
}

impl Default for Name {
    fn default() -> Self {
        Name::from("")
    }
}

impl std::ops::Deref for Name {
    type Target = str;
    fn deref(&self) -> &str {
        self.as_str()
    }
}

impl AsRef<str> for Name {
    fn as_ref(&self) -> &str {
        self.as_str()
    }
}

impl std::borrow::Borrow<str> for Name {
    fn borrow(&self) -> &str {
        self.as_str()
    }
}

impl PartialEq for Name {
    fn eq(&self, other: &Self) -> bool {
        self.as_bytes() == other.as_bytes()
    }
}

impl Eq for Name {}

impl PartialEq<str> for Name {
    fn eq(&self, other: &str) -> bool {
        self.as_bytes() == other.as_bytes()
    }
}

impl PartialOrd for Name {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Name {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.as_bytes().cmp(other.as_bytes())
    }
}

impl Hash for Name {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.as_str().hash(state)
    }
}

impl fmt::Debug for Name {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self.as_str(), f)
    }
}

impl fmt::Display for Name {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_and_long_names_read_back_and_compare_as_their_text() {
        let long = "a tenant whose name is longer than any held inline";
        for s in ["", "a", "acme", "éàü-テナント", long] {
            let a = Name::from(s);
            let b = Name::from(Arc::<str>::from(s));
            assert_eq!(&*a, s);
            assert_eq!(a, b);
            assert_eq!(a.as_bytes(), s.as_bytes());
            assert_eq!(format!("{a:?}"), format!("{s:?}"));
        }
        assert!(matches!(Name::from("acme").0, Repr::Inline { .. }));
        assert!(matches!(Name::from(long).0, Repr::Shared(_)));
        assert_ne!(Name::from("acme"), Name::from("acme2"));
        let (a, b) = (Name::from("a"), Name::from("b"));
        assert_eq!(a.cmp(&b), std::cmp::Ordering::Less);
    }
}
