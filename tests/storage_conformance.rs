//! One suite, two object stores: the local directory and S3 (a real s3s-fs server).

mod common;

use std::sync::Arc;

use bytes::Bytes;
use common::Backend;
use futures_util::StreamExt;
use nightshift::storage::{Key, ObjectStore, StorageError};

fn key(raw: &str) -> Key {
    Key::parse(raw).unwrap()
}

async fn read_all(store: &dyn ObjectStore, key: &Key, range: Option<std::ops::Range<u64>>) -> Vec<u8> {
    let mut stream = store.read(key, range).await.unwrap();
    let mut out = Vec::new();
    while let Some(chunk) = stream.next().await {
        out.extend_from_slice(&chunk.unwrap());
    }
    out
}

async fn put_get_and_size_round_trip(store: Arc<dyn ObjectStore>) {
    let k = key("a/b/object.json");
    store.put(&k, Bytes::from_static(b"{\"hello\":\"w\xc3\xb6rld\"}")).await.unwrap();
    assert_eq!(&store.get(&k).await.unwrap()[..], b"{\"hello\":\"w\xc3\xb6rld\"}");
    assert_eq!(store.size(&k).await.unwrap(), Some(18));
}

async fn missing_objects_are_not_found(store: Arc<dyn ObjectStore>) {
    let k = key("nothing/here");
    assert!(matches!(store.get(&k).await, Err(StorageError::NotFound(_))));
    assert!(matches!(store.read(&k, Some(0..10)).await, Err(StorageError::NotFound(_))));
    assert!(matches!(store.read(&k, Some(3..3)).await, Err(StorageError::NotFound(_))));
    assert_eq!(store.size(&k).await.unwrap(), None);
    store.delete(&k).await.expect("deleting a missing object is fine");
}

async fn overwrite_replaces_and_delete_removes(store: Arc<dyn ObjectStore>) {
    let k = key("x/y");
    store.put(&k, Bytes::from_static(b"first version, longer")).await.unwrap();
    store.put(&k, Bytes::from_static(b"second")).await.unwrap();
    assert_eq!(&store.get(&k).await.unwrap()[..], b"second");
    store.delete(&k).await.unwrap();
    assert_eq!(store.size(&k).await.unwrap(), None);
}

async fn ranges_read_the_slice_and_clamp_at_the_end(store: Arc<dyn ObjectStore>) {
    let k = key("ranges/digits");
    store.put(&k, Bytes::from_static(b"0123456789")).await.unwrap();
    assert_eq!(read_all(store.as_ref(), &k, Some(2..5)).await, b"234");
    assert_eq!(read_all(store.as_ref(), &k, Some(7..100)).await, b"789");
    assert_eq!(read_all(store.as_ref(), &k, Some(4..4)).await, b"");
    assert_eq!(read_all(store.as_ref(), &k, Some(10..20)).await, b"");
    assert_eq!(read_all(store.as_ref(), &k, Some(50..60)).await, b"");
    assert_eq!(read_all(store.as_ref(), &k, None).await, b"0123456789");
}

async fn list_returns_sorted_keys_under_the_prefix_only(store: Arc<dyn ObjectStore>) {
    for raw in ["p/one/c", "p/one/a", "p/one/b.json", "p/onex/z", "p/two/a", "q/one/a"] {
        store.put(&key(raw), Bytes::from_static(b"x")).await.unwrap();
    }
    let names = |keys: Vec<Key>| keys.iter().map(|k| k.to_string()).collect::<Vec<_>>();
    assert_eq!(names(store.list("p/one/").await.unwrap()), ["p/one/a", "p/one/b.json", "p/one/c"]);
    assert_eq!(names(store.list("p/one").await.unwrap()), ["p/one/a", "p/one/b.json", "p/one/c", "p/onex/z"]);
    assert_eq!(store.list("p/").await.unwrap().len(), 5);
    assert!(store.list("nothing/").await.unwrap().is_empty());
}

async fn large_objects_stream_in_and_out_whole(store: Arc<dyn ObjectStore>) {
    // Larger than one S3 part, written in uneven chunks.
    let data: Vec<u8> =
        (0..20 * 1024 * 1024 + 12_345).map(|i: u32| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
    let k = key("big/object");
    let mut writer = store.writer(&k).await.unwrap();
    for chunk in data.chunks(1_000_003) {
        writer.write(Bytes::copy_from_slice(chunk)).await.unwrap();
    }
    assert_eq!(store.size(&k).await.unwrap(), None, "nothing is visible before finish");
    assert_eq!(writer.finish().await.unwrap(), data.len() as u64);
    assert_eq!(store.size(&k).await.unwrap(), Some(data.len() as u64));
    assert!(read_all(store.as_ref(), &k, None).await == data);
    let middle = 9 * 1024 * 1024 - 7..9 * 1024 * 1024 + 70_001;
    assert!(read_all(store.as_ref(), &k, Some(middle.start as u64..middle.end as u64)).await == data[middle]);
}

async fn aborted_and_dropped_writers_leave_nothing(store: Arc<dyn ObjectStore>) {
    let aborted = key("partial/aborted");
    let mut writer = store.writer(&aborted).await.unwrap();
    writer.write(Bytes::from(vec![7u8; 9 * 1024 * 1024])).await.unwrap();
    writer.abort().await;
    let dropped = key("partial/dropped");
    let mut writer = store.writer(&dropped).await.unwrap();
    writer.write(Bytes::from_static(b"half")).await.unwrap();
    drop(writer);
    assert_eq!(store.size(&aborted).await.unwrap(), None);
    assert_eq!(store.size(&dropped).await.unwrap(), None);
    assert!(store.list("partial/").await.unwrap().is_empty());
}

async fn an_unfinished_write_keeps_the_previous_version(store: Arc<dyn ObjectStore>) {
    let k = key("versions/object");
    store.put(&k, Bytes::from_static(b"v1")).await.unwrap();
    let mut writer = store.writer(&k).await.unwrap();
    writer.write(Bytes::from_static(b"v2 but never finished")).await.unwrap();
    assert_eq!(&store.get(&k).await.unwrap()[..], b"v1");
    writer.abort().await;
    assert_eq!(&store.get(&k).await.unwrap()[..], b"v1");
}

macro_rules! conformance {
    ($($case:ident),* $(,)?) => {
        mod dir {
            $(
                #[tokio::test]
                async fn $case() {
                    let (_backend, store) = super::Backend::dir().await;
                    super::$case(store).await;
                }
            )*
        }
        mod s3 {
            $(
                #[tokio::test]
                async fn $case() {
                    let (_backend, store) = super::Backend::s3().await;
                    super::$case(store).await;
                }
            )*
        }
    };
}

conformance!(
    put_get_and_size_round_trip,
    missing_objects_are_not_found,
    overwrite_replaces_and_delete_removes,
    ranges_read_the_slice_and_clamp_at_the_end,
    list_returns_sorted_keys_under_the_prefix_only,
    large_objects_stream_in_and_out_whole,
    aborted_and_dropped_writers_leave_nothing,
    an_unfinished_write_keeps_the_previous_version,
);
