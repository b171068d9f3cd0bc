//! The names a router serves its model under: `--served-model-name` (several allowed, as
//! vLLM's), else the model folder's name. A request may name any served name or the
//! folder; responses carry the first served name.

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServedModel {
    /// `--served-model-name` values in order (empty: the folder's name is the served name).
    pub names: Vec<String>,
    /// The model folder's name (`pdserve-embedded` for the embedded model): always accepted
    /// in requests, so clients written against the folder keep working after a rename.
    pub folder: String,
}

impl ServedModel {
    /// The name responses carry (`model` of completions).
    pub fn primary(&self) -> &str {
        self.names.first().unwrap_or(&self.folder)
    }

    /// The names `GET /v1/models` lists, primary first.
    pub fn listed(&self) -> Vec<&str> {
        if self.names.is_empty() {
            vec![self.folder.as_str()]
        } else {
            self.names.iter().map(String::as_str).collect()
        }
    }

    /// Whether a request naming `model` is for this model.
    pub fn accepts(&self, model: &str) -> bool {
        model == self.folder || self.names.iter().any(|n| n == model)
    }
}

/// A `--served-model-name` value that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BadName {
    #[error(
        "--served-model-name `{0}`: a name must be non-empty, without leading or trailing spaces"
    )]
    Blank(String),
    #[error("--served-model-name `{0}` is given twice")]
    Repeated(String),
}

/// Every name non-empty, without surrounding spaces (a client could never match it), and
/// given once.
pub fn check_names(names: &[String]) -> Result<(), BadName> {
    for (i, n) in names.iter().enumerate() {
        if n.is_empty() || n.trim() != n {
            return Err(BadName::Blank(n.clone()));
        }
        if names[..i].contains(n) {
            return Err(BadName::Repeated(n.clone()));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn served(names: &[&str]) -> ServedModel {
        ServedModel {
            names: names.iter().map(|n| n.to_string()).collect(),
            folder: "DeepSeek-V4-Flash".into(),
        }
    }

    #[test]
    fn without_served_names_the_folder_is_the_model() {
        let m = served(&[]);
        assert_eq!(m.primary(), "DeepSeek-V4-Flash");
        assert_eq!(m.listed(), ["DeepSeek-V4-Flash"]);
        assert!(m.accepts("DeepSeek-V4-Flash"));
        assert!(!m.accepts("deepseek-v4-flash"), "names are case-sensitive");
        assert!(!m.accepts(""));
    }

    #[test]
    fn served_names_are_listed_and_the_folder_still_accepted() {
        let m = served(&["ds-v4", "deepseek"]);
        assert_eq!(m.primary(), "ds-v4");
        assert_eq!(m.listed(), ["ds-v4", "deepseek"]);
        for ok in ["ds-v4", "deepseek", "DeepSeek-V4-Flash"] {
            assert!(m.accepts(ok), "{ok}");
        }
        assert!(!m.accepts("gpt-4"));
    }

    #[test]
    fn blank_and_repeated_names_are_refused() {
        let v = |n: &[&str]| n.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(check_names(&v(&["a", "b"])), Ok(()));
        assert_eq!(check_names(&v(&[])), Ok(()));
        assert_eq!(check_names(&v(&["a", ""])), Err(BadName::Blank("".into())));
        assert_eq!(check_names(&v(&[" a"])), Err(BadName::Blank(" a".into())));
        assert_eq!(
            check_names(&v(&["a", "b", "a"])),
            Err(BadName::Repeated("a".into()))
        );
    }
}
