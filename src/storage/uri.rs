//! `s3://bucket/key` locations, as a user names an applied Batch's input and output.
//! Pure: parsed once at the edge into a bucket and a [`Key`].

use std::fmt;

use super::Key;

/// An object (or, for a prefix, the start of a key) in a bucket.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct S3Uri {
    pub bucket: String,
    /// The key; for a prefix, without its trailing `/` (a prefix may be empty: the bucket).
    pub key: Option<Key>,
}

#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum UriError {
    #[error("{0:?} is not an s3:// URI (s3://bucket/key)")]
    Scheme(String),
    #[error("{0:?} names no bucket (s3://bucket/key)")]
    Bucket(String),
    #[error(
        "the key of {0:?} is not one Nightshift reads or writes: segments of letters, digits, '-', '_', '.' and '=', \
         none empty or starting with '.'"
    )]
    Key(String),
    #[error("{0:?} names no object (s3://bucket/key, not a prefix)")]
    NoObject(String),
}

/// A bucket name as S3 allows it (3 to 63 of lowercase letters, digits, '.', '-').
fn valid_bucket(bucket: &str) -> bool {
    (3..=63).contains(&bucket.len())
        && bucket.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'.' || b == b'-')
        && bucket.starts_with(|c: char| c.is_ascii_alphanumeric())
        && bucket.ends_with(|c: char| c.is_ascii_alphanumeric())
}

impl S3Uri {
    fn parse_any(raw: &str) -> Result<Self, UriError> {
        let rest = raw.strip_prefix("s3://").ok_or_else(|| UriError::Scheme(raw.to_owned()))?;
        let (bucket, key) = rest.split_once('/').unwrap_or((rest, ""));
        if !valid_bucket(bucket) {
            return Err(UriError::Bucket(raw.to_owned()));
        }
        let key = key.trim_end_matches('/');
        let key = match key {
            "" => None,
            key => Some(Key::parse(key).ok_or_else(|| UriError::Key(raw.to_owned()))?),
        };
        Ok(Self { bucket: bucket.to_owned(), key })
    }

    /// An object: `s3://bucket/key`, the key not ending in `/`.
    pub fn object(raw: &str) -> Result<Self, UriError> {
        if raw.ends_with('/') {
            return Err(UriError::NoObject(raw.to_owned()));
        }
        let uri = Self::parse_any(raw)?;
        match uri.key {
            Some(_) => Ok(uri),
            None => Err(UriError::NoObject(raw.to_owned())),
        }
    }

    /// A prefix: `s3://bucket/`, `s3://bucket/some/prefix/` (the trailing `/` optional).
    pub fn prefix(raw: &str) -> Result<Self, UriError> {
        Self::parse_any(raw)
    }

    /// The object `name` under this prefix.
    pub fn join(&self, name: &str) -> Self {
        let key = match &self.key {
            Some(prefix) => Key::from_segments(&[prefix.as_str(), name]),
            None => Key::from_segments(&[name]),
        };
        Self { bucket: self.bucket.clone(), key: Some(key) }
    }

    /// The key's last segment (for an object: its file name).
    pub fn name(&self) -> Option<&str> {
        self.key.as_ref().map(Key::name)
    }
}

impl fmt::Display for S3Uri {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.key {
            Some(key) => write!(f, "s3://{}/{}", self.bucket, key),
            None => write!(f, "s3://{}/", self.bucket),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn objects_and_prefixes_parse_and_the_rest_is_refused_with_a_reason() {
        let object = S3Uri::object("s3://data-lake/evals/2026-11/input.jsonl").unwrap();
        assert_eq!(object.bucket, "data-lake");
        assert_eq!(object.name(), Some("input.jsonl"));
        assert_eq!(object.to_string(), "s3://data-lake/evals/2026-11/input.jsonl");

        let prefix = S3Uri::prefix("s3://data-lake/results/").unwrap();
        assert_eq!(prefix.join("output.jsonl").to_string(), "s3://data-lake/results/output.jsonl");
        assert_eq!(S3Uri::prefix("s3://data-lake").unwrap().join("x.jsonl").to_string(), "s3://data-lake/x.jsonl");

        let cases = [
            ("https://data-lake/in.jsonl", UriError::Scheme("https://data-lake/in.jsonl".into())),
            ("s3:///in.jsonl", UriError::Bucket("s3:///in.jsonl".into())),
            ("s3://Data_Lake/in.jsonl", UriError::Bucket("s3://Data_Lake/in.jsonl".into())),
            ("s3://data-lake/", UriError::NoObject("s3://data-lake/".into())),
            ("s3://data-lake", UriError::NoObject("s3://data-lake".into())),
            ("s3://data-lake/a/../b.jsonl", UriError::Key("s3://data-lake/a/../b.jsonl".into())),
            ("s3://data-lake/my file.jsonl", UriError::Key("s3://data-lake/my file.jsonl".into())),
            ("s3://data-lake/a//b.jsonl", UriError::Key("s3://data-lake/a//b.jsonl".into())),
        ];
        for (raw, error) in cases {
            assert_eq!(S3Uri::object(raw), Err(error), "{raw}");
        }
    }
}
