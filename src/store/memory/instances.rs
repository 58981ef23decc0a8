//! A tenant's instances as the memory store keeps them: sorted by name, and held inline while
//! there is only one (the common case: a tenant with one agent, or a caller that is its own
//! tenant), so such a tenant has no list of its own to allocate, keep and reach through.

use super::packed::Packed;

/// A tenant's instances' packed states, sorted by name.
#[derive(Default)]
pub(super) enum Instances {
    /// None held.
    #[default]
    None,
    /// Exactly one, inline.
    One(Packed),
    /// Two or more.
    Many(Vec<Packed>),
}

impl Instances {
    /// The instances, in name order.
    #[inline]
    pub(super) fn as_slice(&self) -> &[Packed] {
        match self {
            Instances::None => &[],
            Instances::One(p) => std::slice::from_ref(p),
            Instances::Many(v) => v,
        }
    }

    /// The instances, in name order, to write.
    #[inline]
    pub(super) fn as_mut_slice(&mut self) -> &mut [Packed] {
        match self {
            Instances::None => &mut [],
            Instances::One(p) => std::slice::from_mut(p),
            Instances::Many(v) => v,
        }
    }

    /// How many are held.
    pub(super) fn len(&self) -> usize {
        self.as_slice().len()
    }

    /// Whether none is held.
    pub(super) fn is_empty(&self) -> bool {
        matches!(self, Instances::None)
    }

    /// Where the instance `name` is, or where it would go.
    #[inline]
    pub(super) fn find(&self, name: &str) -> Result<usize, usize> {
        self.as_slice()
            .binary_search_by(|i| i.name().cmp(name.as_bytes()))
    }

    /// Puts `p` at `at` (as [`find`](Self::find) answered for its name).
    pub(super) fn insert(&mut self, at: usize, p: Packed) {
        *self = match std::mem::take(self) {
            Instances::None => Instances::One(p),
            Instances::One(q) => {
                let mut v = Vec::with_capacity(2);
                if at == 0 {
                    v.extend([p, q]);
                } else {
                    v.extend([q, p]);
                }
                Instances::Many(v)
            }
            Instances::Many(mut v) => {
                if v.len() == v.capacity() {
                    // Grow by a quarter, not double: memory per instance matters more than
                    // the rare copy.
                    v.reserve_exact((v.len() / 4).max(1));
                }
                v.insert(at, p);
                Instances::Many(v)
            }
        };
    }

    /// Keeps the instances `keep` says to, in order; a list left with one goes back inline.
    pub(super) fn retain(&mut self, mut keep: impl FnMut(&Packed) -> bool) {
        match self {
            Instances::None => {}
            Instances::One(p) => {
                if !keep(p) {
                    *self = Instances::None;
                }
            }
            Instances::Many(v) => {
                v.retain(|p| keep(p));
                if v.len() <= 1 {
                    *self = v.pop().map_or(Instances::None, Instances::One);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::admission::engine::NodeState;

    fn named(name: &str) -> Packed {
        Packed::new(name, false, &NodeState::default(), 0, 1.0)
    }

    fn names(i: &Instances) -> Vec<String> {
        i.as_slice()
            .iter()
            .map(|p| String::from_utf8(p.name().to_vec()).expect("utf-8"))
            .collect()
    }

    proptest! {
        /// Inserted where `find` says and retained by any rule, the instances are the sorted
        /// set a plain sorted list holds, and one left alone is held inline.
        #[test]
        fn instances_stay_sorted_and_one_is_inline(
            steps in proptest::collection::vec((0u8..12, any::<bool>()), 0..40),
        ) {
            let mut held = Instances::default();
            let mut model: Vec<String> = Vec::new();
            for (n, drop_odd) in steps {
                let name = format!("agent-{n}");
                match held.find(&name) {
                    Ok(at) => prop_assert_eq!(&model[at], &name),
                    Err(at) => {
                        held.insert(at, named(&name));
                        let m = model.binary_search(&name).expect_err("new");
                        model.insert(m, name);
                    }
                }
                if drop_odd {
                    let odd = |s: &[u8]| s.last().is_some_and(|b| b % 2 == 1);
                    held.retain(|p| !odd(p.name()));
                    model.retain(|s| !odd(s.as_bytes()));
                }
                prop_assert_eq!(names(&held), model.clone());
                prop_assert_eq!(held.len(), model.len());
                prop_assert_eq!(held.is_empty(), model.is_empty());
                prop_assert_eq!(matches!(held, Instances::One(_)), model.len() == 1);
            }
        }
    }
}
