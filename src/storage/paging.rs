//! A page of objects read through a directory listing: the one loop behind the file and
//! batch listings.

use futures_util::{StreamExt, TryStreamExt};

use super::{Key, ObjectStore, StorageError};

/// How many objects are read from storage at once (at most).
const READ_AHEAD: usize = 16;
/// The fewest keys listed at once: a small page that skips many keys should not take a
/// listing per key.
const MIN_KEYS: usize = 32;

/// The first `limit` objects that `read` finds for the keys directly in the directory
/// `prefix`, in key order after `start_after`, and whether more follow. `read` turns a
/// key into its object, or `None` to skip it (a marker without its record, a deleted
/// file, another purpose). Costs in proportion to the page and the keys it skips.
pub async fn read_page<T, E, F, Fut>(
    store: &dyn ObjectStore,
    prefix: &str,
    start_after: Option<String>,
    limit: usize,
    read: F,
) -> Result<(Vec<T>, bool), E>
where
    E: From<StorageError>,
    F: Fn(Key) -> Fut,
    Fut: Future<Output = Result<Option<T>, E>>,
{
    let wanted = limit + 1;
    let mut cursor = start_after;
    let mut found = Vec::new();
    loop {
        let page = store.list_page(prefix, cursor.as_deref(), wanted.max(MIN_KEYS)).await?;
        cursor = page.keys.last().map(Key::to_string);
        let room = wanted - found.len();
        let mut more = futures_util::stream::iter(page.keys)
            .map(&read)
            .buffered(READ_AHEAD.min(wanted))
            .try_filter_map(|object| async move { Ok(object) })
            .take(room)
            .try_collect::<Vec<_>>()
            .await?;
        found.append(&mut more);
        if found.len() >= wanted || !page.more {
            break;
        }
    }
    let more = found.len() > limit;
    found.truncate(limit);
    Ok((found, more))
}
