//! Files: the records and bytes behind `/v1/files`, and their garbage collection.

mod catalog;
pub mod expiry;
mod gc;
mod record;

pub use catalog::{FileCatalog, FileListQuery, FilePage, NewFile, Order, Upload};
pub use expiry::{ExpiresAfter, ExpiryError};
pub use gc::run_gc_loop;
pub use record::{FileObject, FileRecord, Purpose};

/// The largest upload (the spec's 100 MB).
pub const MAX_UPLOAD_BYTES: u64 = 100 * 1024 * 1024;
