//! Identifiers with the spec's prefixes, parsed at the edge.
//!
//! New ids are ULIDs behind their prefix: lexical order is creation order, which is
//! what the list endpoints page by. A process-wide monotonic generator keeps ids made
//! in the same millisecond strictly increasing.

use std::fmt;
use std::sync::{LazyLock, Mutex};

use serde::{Deserialize, Serialize};
use ulid::{Generator, Ulid};

static GENERATOR: LazyLock<Mutex<Generator>> = LazyLock::new(|| Mutex::new(Generator::new()));

fn next_ulid() -> Ulid {
    let mut generator = GENERATOR.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    // The monotonic generator only fails when 2^80 ids are made in one millisecond.
    generator.generate().unwrap_or_else(|_| Ulid::new())
}

/// The creation time of a ULID body, in Unix seconds.
fn created_at(body: &str) -> Option<i64> {
    let ulid = Ulid::from_string(body).ok()?;
    i64::try_from(ulid.timestamp_ms() / 1000).ok()
}

/// The characters an id may hold after its prefix: ids become storage keys, so no
/// separators, dots or anything a path or URL would treat specially.
fn is_id_body(body: &str) -> bool {
    !body.is_empty() && body.len() <= 100 && body.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

macro_rules! prefixed_id {
    ($(#[$doc:meta])* $name:ident, $prefix:literal, $pattern:literal) => {
        $(#[$doc])*
        ///
        /// Decoding checks it (see `parse`): a hand-made resource or document with a bad id
        /// fails to decode instead of reaching storage keys.
        #[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
        #[serde(try_from = "String", into = "String")]
        pub struct $name(String);

        impl $name {
            pub const PREFIX: &'static str = $prefix;
            /// What the CRD schema lets the API server accept.
            pub const PATTERN: &'static str = $pattern;

            /// A new, time-sortable id.
            pub fn generate() -> Self {
                Self(format!("{}{}", $prefix, next_ulid()))
            }

            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl TryFrom<String> for $name {
            type Error = String;
            fn try_from(raw: String) -> Result<Self, Self::Error> {
                Self::parse(&raw).ok_or_else(|| format!("{raw:?} is not a valid {} id", stringify!($name)))
            }
        }

        impl From<$name> for String {
            fn from(id: $name) -> Self {
                id.0
            }
        }

        impl schemars::JsonSchema for $name {
            fn schema_name() -> std::borrow::Cow<'static, str> {
                stringify!($name).into()
            }

            fn inline_schema() -> bool {
                true
            }

            fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
                schemars::json_schema!({"type": "string", "pattern": $pattern, "maxLength": 110})
            }
        }
    };
}

prefixed_id!(
    /// `file-<ULID>`; legacy `file_<...>` ids stay resolvable (see [`FileId::parse`]).
    FileId,
    "file-",
    "^file[-_][A-Za-z0-9_-]{1,100}$"
);
prefixed_id!(
    /// `batch_<ULID>`.
    BatchId,
    "batch_",
    "^batch_[A-Za-z0-9_-]{1,100}$"
);
prefixed_id!(
    /// `batch_req_<ULID>`: one per input line, fixed when the line is first recorded.
    LineId,
    "batch_req_",
    "^batch_req_[A-Za-z0-9_-]{1,100}$"
);
prefixed_id!(
    /// `req_<ULID>`: the `x-request-id` of one HTTP exchange.
    RequestId,
    "req_",
    "^req_[A-Za-z0-9_-]{1,100}$"
);

prefixed_id!(
    /// `upload_<ULID>`: an Upload of the Uploads API.
    UploadId,
    "upload_",
    "^upload_[A-Za-z0-9_-]{1,100}$"
);
prefixed_id!(
    /// `part_<ULID>`: one Part of an Upload.
    PartId,
    "part_",
    "^part_[A-Za-z0-9_-]{1,100}$"
);

const LEGACY_FILE_PREFIX: &str = "file_";

impl FileId {
    /// Accepts `file-…` and the legacy `file_…` spelling; anything else is no file id.
    pub fn parse(raw: &str) -> Option<Self> {
        let body = raw.strip_prefix(Self::PREFIX).or_else(|| raw.strip_prefix(LEGACY_FILE_PREFIX))?;
        is_id_body(body).then(|| Self(raw.to_owned()))
    }

    /// The same id in the other spelling (`file-X` ⇄ `file_X`): records written before
    /// the prefix was normalised are stored under `file_`, and clients may hold either.
    pub fn other_spelling(&self) -> Self {
        match self.0.strip_prefix(Self::PREFIX) {
            Some(body) => Self(format!("{LEGACY_FILE_PREFIX}{body}")),
            None => Self(format!("{}{}", Self::PREFIX, &self.0[LEGACY_FILE_PREFIX.len()..])),
        }
    }
}

impl FileId {
    /// When the id was made (Unix seconds), if it is a ULID id.
    pub fn created_at(&self) -> Option<i64> {
        created_at(&self.0[Self::PREFIX.len()..])
    }
}

impl BatchId {
    /// When the id was made (Unix seconds), if it is a ULID id.
    pub fn created_at(&self) -> Option<i64> {
        created_at(&self.0[Self::PREFIX.len()..])
    }

    pub fn parse(raw: &str) -> Option<Self> {
        let body = raw.strip_prefix(Self::PREFIX)?;
        is_id_body(body).then(|| Self(raw.to_owned()))
    }
}

impl UploadId {
    pub fn parse(raw: &str) -> Option<Self> {
        is_id_body(raw.strip_prefix(Self::PREFIX)?).then(|| Self(raw.to_owned()))
    }

    /// When the id was made (Unix seconds), if it is a ULID id.
    pub fn created_at(&self) -> Option<i64> {
        created_at(&self.0[Self::PREFIX.len()..])
    }

    /// The id of the file that completing this upload makes: the same for every
    /// completion, so that two racing completions write one file, not two.
    pub fn file_id(&self) -> FileId {
        FileId(format!("{}{}", FileId::PREFIX, &self.0[Self::PREFIX.len()..]))
    }
}

impl PartId {
    pub fn parse(raw: &str) -> Option<Self> {
        is_id_body(raw.strip_prefix(Self::PREFIX)?).then(|| Self(raw.to_owned()))
    }

    /// When the part was received (Unix seconds), if it is a ULID id.
    pub fn created_at(&self) -> Option<i64> {
        created_at(&self.0[Self::PREFIX.len()..])
    }
}

impl LineId {
    pub fn parse(raw: &str) -> Option<Self> {
        is_id_body(raw.strip_prefix(Self::PREFIX)?).then(|| Self(raw.to_owned()))
    }

    /// Wraps an id made or read back by the executor (its own format, see `records::line_id`).
    pub fn from_stored(raw: String) -> Self {
        Self(raw)
    }
}

impl RequestId {
    pub fn parse(raw: &str) -> Option<Self> {
        is_id_body(raw.strip_prefix(Self::PREFIX)?).then(|| Self(raw.to_owned()))
    }
}

/// A project's id: a UUID, kept in its canonical lowercase hyphenated form.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct ProjectId(String);

impl ProjectId {
    pub fn parse(raw: &str) -> Option<Self> {
        uuid::Uuid::parse_str(raw.trim()).ok().map(|uuid| Self(uuid.hyphenated().to_string()))
    }

    pub fn generate() -> Self {
        Self(uuid::Uuid::new_v4().hyphenated().to_string())
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl schemars::JsonSchema for ProjectId {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "ProjectId".into()
    }

    fn inline_schema() -> bool {
        true
    }

    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({
            "type": "string",
            "pattern": "^[0-9a-fA-F]{8}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{12}$"
        })
    }
}

impl TryFrom<String> for ProjectId {
    type Error = String;
    fn try_from(raw: String) -> Result<Self, Self::Error> {
        Self::parse(&raw).ok_or_else(|| format!("project id {raw:?} is not a UUID"))
    }
}

impl From<ProjectId> for String {
    fn from(id: ProjectId) -> Self {
        id.0
    }
}

impl fmt::Display for ProjectId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_checked_when_decoded() {
        for bad in [r#""../x""#, r#""file-../x""#, r#""file-a/b""#, r#""batch_""#, r#""""#, r#""file-.""#] {
            assert!(serde_json::from_str::<FileId>(bad).is_err(), "{bad} decoded as a file id");
            assert!(serde_json::from_str::<BatchId>(bad).is_err(), "{bad} decoded as a batch id");
        }
        let id: FileId = serde_json::from_str(r#""file-01ABC""#).unwrap();
        assert_eq!(serde_json::to_string(&id).unwrap(), r#""file-01ABC""#);
        let id: BatchId = serde_json::from_str(r#""batch_01ABC""#).unwrap();
        assert_eq!(id.as_str(), "batch_01ABC");
        assert!(serde_json::from_str::<LineId>(r#""batch_req_0f""#).is_ok());
    }

    #[test]
    fn generated_ids_sort_in_creation_order() {
        let ids: Vec<FileId> = (0..1000).map(|_| FileId::generate()).collect();
        let mut sorted = ids.clone();
        sorted.sort();
        assert_eq!(ids, sorted);
        assert!(ids[0].as_str().starts_with("file-"));
    }

    #[test]
    fn file_ids_accept_both_spellings_and_nothing_else() {
        assert!(FileId::parse("file-01HZX").is_some());
        assert!(FileId::parse("file_01HZX").is_some());
        for bad in ["", "file-", "file_", "batch_1", "file-a/b", "file-..", "file-a b", "FILE-1"] {
            assert!(FileId::parse(bad).is_none(), "{bad:?} parsed");
        }
        let id = FileId::parse("file-ABC").unwrap();
        assert_eq!(id.other_spelling().as_str(), "file_ABC");
        assert_eq!(id.other_spelling().other_spelling(), id);
    }

    #[test]
    fn project_ids_are_canonical_uuids() {
        let id = ProjectId::parse("3F6C1F4E-8B8F-4B59-9A55-0D6F1B8A2E11").unwrap();
        assert_eq!(id.as_str(), "3f6c1f4e-8b8f-4b59-9a55-0d6f1b8a2e11");
        assert!(ProjectId::parse("not-a-uuid").is_none());
    }
}
