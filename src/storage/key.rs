//! Storage keys, checked once so that no backend has to re-validate strings.

use std::fmt;

/// A `/`-separated object key whose segments are non-empty and free of anything a
/// filesystem or URL treats specially (`.`/`..`, backslashes, control characters).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Key(String);

impl Key {
    pub fn parse(raw: &str) -> Option<Self> {
        let valid = !raw.is_empty()
            && raw.len() <= 512
            && raw.split('/').all(|segment| {
                !segment.is_empty()
                    && !segment.starts_with('.')
                    && segment.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'='))
            });
        valid.then(|| Self(raw.to_owned()))
    }

    /// Builds a key from segments the caller has already made safe (ids, fixed names).
    ///
    /// # Panics
    /// When a segment is not a valid key segment: that is a bug in the caller.
    pub fn from_segments(segments: &[&str]) -> Self {
        let joined = segments.join("/");
        Self::parse(&joined).unwrap_or_else(|| panic!("invalid storage key {joined:?}"))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The last segment.
    pub fn name(&self) -> &str {
        self.0.rsplit('/').next().unwrap_or(&self.0)
    }
}

impl fmt::Display for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_reject_path_tricks() {
        for bad in ["", "/a", "a/", "a//b", "../a", "a/../b", ".hidden", "a b", "a\\b", "a\0b"] {
            assert!(Key::parse(bad).is_none(), "{bad:?} accepted");
        }
        let key = Key::parse("file-meta/p-1/file-01.json").unwrap();
        assert_eq!(key.name(), "file-01.json");
    }
}
