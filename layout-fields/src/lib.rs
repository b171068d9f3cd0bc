//! THE comparison of two KV layouts given as named fields (`KvLayout::fields` on one side,
//! the same list after crossing the wire on the other). It lives below every user: the
//! engine (comparing its own layouts and a peer's), the KV transfer and the router
//! (pairing two workers' reported layouts), which must not depend on the engine.

/// Where two field lists first differ; `None` on a side that lacks the field.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FieldDiff<'a> {
    pub field: &'a str,
    pub ours: Option<&'a str>,
    pub theirs: Option<&'a str>,
}

/// The first field whose value differs, in `ours`' order, then the first field only
/// `theirs` has; `None` when both lists name the same fields with the same values.
pub fn first_difference<'a>(
    ours: &[(&'a str, &'a str)],
    theirs: &[(&'a str, &'a str)],
) -> Option<FieldDiff<'a>> {
    let value = |list: &[(&'a str, &'a str)], name: &str| {
        list.iter().find(|(n, _)| *n == name).map(|(_, v)| *v)
    };
    for &(field, ours_value) in ours {
        let theirs_value = value(theirs, field);
        if theirs_value != Some(ours_value) {
            return Some(FieldDiff {
                field,
                ours: Some(ours_value),
                theirs: theirs_value,
            });
        }
    }
    theirs
        .iter()
        .find(|(n, _)| value(ours, n).is_none())
        .map(|&(field, v)| FieldDiff {
            field,
            ours: None,
            theirs: Some(v),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    const OURS: [(&str, &str); 2] = [("page_tokens", "256"), ("index_k_dtype", "f32")];

    #[test]
    fn equal_lists_in_any_order_agree() {
        let swapped = [OURS[1], OURS[0]];
        assert_eq!(first_difference(&OURS, &swapped), None);
    }

    #[test]
    fn names_the_first_differing_missing_or_extra_field() {
        let other = [("page_tokens", "256"), ("index_k_dtype", "bf16")];
        let d = first_difference(&OURS, &other);
        assert_eq!(
            d,
            Some(FieldDiff {
                field: "index_k_dtype",
                ours: Some("f32"),
                theirs: Some("bf16")
            })
        );
        let missing = [("index_k_dtype", "f32")];
        let d = first_difference(&OURS, &missing).map(|d| (d.field, d.theirs));
        assert_eq!(d, Some(("page_tokens", None)));
        let extra = [OURS[0], OURS[1], ("kv_dtype", "bf16")];
        let d = first_difference(&OURS, &extra).map(|d| (d.field, d.ours));
        assert_eq!(d, Some(("kv_dtype", None)));
    }
}
