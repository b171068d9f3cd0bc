//! Comparing this process's [`KvLayout`] with a peer's, when only the peer's named
//! fields ([`KvLayout::fields`]) have crossed the wire.

use super::layout::{KvLayout, LayoutError};
use pdserve_layout_fields::first_difference;

impl KvLayout {
    /// Refuse a peer whose named fields differ from ours, naming the first differing field
    /// in our field order (a field present on one side only counts as differing).
    pub fn check_peer_fields(&self, theirs: &[(String, String)]) -> Result<(), LayoutError> {
        let ours = self.fields();
        match first_difference(&pairs(&ours), &pairs(theirs)) {
            None => Ok(()),
            Some(d) => Err(LayoutError::Mismatch {
                field: d.field.to_string(),
                ours: d.ours.unwrap_or("absent").to_string(),
                theirs: d.theirs.unwrap_or("absent").to_string(),
            }),
        }
    }
}

fn pairs(fields: &[(String, String)]) -> Vec<(&str, &str)> {
    fields
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use crate::config::ModelConfig;
    use crate::kv::{EntryDtype, KvLayout, KvLayoutSpec, LayoutError};

    fn layout(index_k: EntryDtype) -> KvLayout {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/embedded");
        let cfg = ModelConfig::from_model_dir(&dir).unwrap();
        let mut spec = KvLayoutSpec::default_for(&cfg);
        spec.index_k_dtype = index_k;
        KvLayout::new(&cfg, spec).unwrap()
    }

    #[test]
    fn peer_fields_agree_with_check_compatible() {
        let a = layout(EntryDtype::F32);
        let b = layout(EntryDtype::Bf16);
        a.check_peer_fields(&a.fields()).unwrap();
        let by_fields = a.check_peer_fields(&b.fields()).unwrap_err();
        assert_eq!(by_fields, a.check_compatible(&b).unwrap_err());
        assert!(
            matches!(by_fields, LayoutError::Mismatch { ref field, .. } if field == "index_k_dtype")
        );
        let mut missing = a.fields();
        missing.retain(|(k, _)| k != "page_bytes");
        let e = a.check_peer_fields(&missing).unwrap_err();
        assert!(
            matches!(e, LayoutError::Mismatch { ref field, ref theirs, .. } if field == "page_bytes" && theirs == "absent")
        );
        let mut extra = a.fields();
        extra.push(("new_field".into(), "1".into()));
        let e = a.check_peer_fields(&extra).unwrap_err();
        assert!(matches!(e, LayoutError::Mismatch { ref field, .. } if field == "new_field"));
    }
}
