//! Files: the records and bytes behind `/v1/files` (their garbage collection, with the
//! uploads' and idempotency keys': `crate::roles::gc`).

mod catalog;
pub mod expiry;
mod record;

pub use catalog::{FileCatalog, FileListQuery, FilePage, NewFile, Order, Upload};
pub use expiry::{ExpiresAfter, ExpiryError};
pub use record::{FileObject, FileRecord, Purpose};

/// The largest upload (the spec's 100 MB).
pub const MAX_UPLOAD_BYTES: u64 = 100 * 1024 * 1024;
