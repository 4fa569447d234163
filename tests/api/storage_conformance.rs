//! One suite, two object stores: the local directory and S3 (a real s3s-fs server).

use crate::common;

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use common::{Backend, TestS3};
use futures_util::StreamExt;
use nightshift::storage::{ABANDONED_AFTER, DirStore, Key, ObjectStore, S3Store, StorageError};

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

async fn pages_start_after_the_cursor_and_say_whether_more_follow(store: Arc<dyn ObjectStore>) {
    for n in (0..25).rev() {
        store.put(&key(&format!("pages/dir/k{n:02}")), Bytes::from_static(b"x")).await.unwrap();
    }
    for raw in ["pages/dir-x/a", "pages/dirz", "pages/dir/sub/deeper"] {
        store.put(&key(raw), Bytes::from_static(b"x")).await.unwrap();
    }
    let names = |page: &nightshift::storage::KeyPage| page.keys.iter().map(|k| k.name().to_owned()).collect::<Vec<_>>();
    let first = store.list_page("pages/dir/", None, 10).await.unwrap();
    assert_eq!(names(&first), (0..10).map(|n| format!("k{n:02}")).collect::<Vec<_>>());
    assert!(first.more);
    let after = first.keys.last().unwrap().to_string();
    let second = store.list_page("pages/dir/", Some(&after), 10).await.unwrap();
    assert_eq!(names(&second)[0], "k10");
    let last = store.list_page("pages/dir/", Some("pages/dir/k19"), 10).await.unwrap();
    assert_eq!(names(&last), ["k20", "k21", "k22", "k23", "k24"]);
    assert!(!last.more, "a page that reaches the end says so");
    // A cursor that names no key pages from where it would sort.
    let between = store.list_page("pages/dir/", Some("pages/dir/k05x"), 2).await.unwrap();
    assert_eq!(names(&between), ["k06", "k07"]);
    // Cursors outside the directory: before all of it, after all of it.
    assert_eq!(names(&store.list_page("pages/dir/", Some("pages/dir-x/a"), 1).await.unwrap()), ["k00"]);
    assert!(store.list_page("pages/dir/", Some("pages/e"), 5).await.unwrap().keys.is_empty());
    assert!(store.list_page("pages/nothing/", None, 5).await.unwrap().keys.is_empty());
    // Pages larger than S3 answers in one call.
    for n in 0..1_005 {
        store.put(&key(&format!("pages/many/k{n:04}")), Bytes::new()).await.unwrap();
    }
    let all = store.list_page("pages/many/", None, 1_003).await.unwrap();
    assert_eq!((all.keys.len(), all.more), (1_003, true));
}

async fn pages_see_writes_and_removals_made_after_the_first(store: Arc<dyn ObjectStore>) {
    store.put(&key("live/dir/b"), Bytes::new()).await.unwrap();
    let names = |page: nightshift::storage::KeyPage| page.keys.iter().map(|k| k.name().to_owned()).collect::<Vec<_>>();
    assert_eq!(names(store.list_page("live/dir/", None, 10).await.unwrap()), ["b"]);
    store.put(&key("live/dir/a"), Bytes::new()).await.unwrap();
    let mut writer = store.writer(&key("live/dir/c")).await.unwrap();
    writer.write(Bytes::from_static(b"unfinished")).await.unwrap();
    assert_eq!(names(store.list_page("live/dir/", None, 10).await.unwrap()), ["a", "b"]);
    writer.finish().await.unwrap();
    store.delete(&key("live/dir/b")).await.unwrap();
    assert_eq!(names(store.list_page("live/dir/", None, 10).await.unwrap()), ["a", "c"]);
}

/// Small sources are streamed; sources of valid S3 part sizes (all but the last at least
/// 5 MiB) are copied server-side on S3. Either way the result is the sources in order.
async fn compose_concatenates_the_sources_in_the_order_given(store: Arc<dyn ObjectStore>) {
    let small = [key("parts/s1"), key("parts/s2"), key("parts/s3")];
    for (n, k) in small.iter().enumerate() {
        store.put(k, Bytes::from(format!("part {n}\n"))).await.unwrap();
    }
    let order = [small[2].clone(), small[0].clone(), small[1].clone()];
    assert_eq!(store.compose(&key("out/small"), &order).await.unwrap(), 21);
    assert_eq!(read_all(store.as_ref(), &key("out/small"), None).await, b"part 2\npart 0\npart 1\n");

    let big: Vec<Vec<u8>> = (0..3u8).map(|n| vec![b'a' + n; if n < 2 { 6 << 20 } else { 1000 }]).collect();
    let parts = [key("parts/b1"), key("parts/b2"), key("parts/b3")];
    for (k, bytes) in parts.iter().zip(&big) {
        store.put(k, Bytes::from(bytes.clone())).await.unwrap();
    }
    let size = store.compose(&key("out/big"), &parts).await.unwrap();
    assert_eq!(size, big.iter().map(Vec::len).sum::<usize>() as u64);
    assert!(read_all(store.as_ref(), &key("out/big"), None).await == big.concat(), "the big parts in order");
    assert_eq!(store.size(&parts[0]).await.unwrap(), Some(6 << 20), "sources are left as they were");

    let missing = [small[0].clone(), key("parts/none")];
    assert!(matches!(store.compose(&key("out/missing"), &missing).await, Err(StorageError::NotFound(_))));
    assert_eq!(store.size(&key("out/missing")).await.unwrap(), None, "no half-made object");
}

/// An exclusive create writes only where nothing is. (That two at once cannot both win is
/// the directory store's own test below: s3s-fs checks, then writes, where S3 is atomic.)
async fn an_exclusive_create_writes_only_where_nothing_is(store: Arc<dyn ObjectStore>) {
    let k = key("claims/one.json");
    assert!(store.create_exclusive(&k, Bytes::from_static(b"first")).await.unwrap());
    assert!(!store.create_exclusive(&k, Bytes::from_static(b"late")).await.unwrap());
    assert_eq!(store.get(&k).await.unwrap(), Bytes::from_static(b"first"));
    store.delete(&k).await.unwrap();
    assert!(store.create_exclusive(&k, Bytes::from_static(b"again")).await.unwrap(), "free again once deleted");
    assert_eq!(store.get(&k).await.unwrap(), Bytes::from_static(b"again"));
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
    pages_start_after_the_cursor_and_say_whether_more_follow,
    pages_see_writes_and_removals_made_after_the_first,
    compose_concatenates_the_sources_in_the_order_given,
    an_exclusive_create_writes_only_where_nothing_is,
);

/// Of many exclusive creates of one key at once, exactly one wins, and its bytes stay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn of_the_directory_stores_exclusive_creates_at_once_one_wins() {
    let (_backend, store) = Backend::dir().await;
    for round in 0..20 {
        let k = key(&format!("claims/{round}.json"));
        let attempts = (0..8).map(|n| {
            let (store, k) = (store.clone(), k.clone());
            tokio::spawn(async move { (n, store.create_exclusive(&k, Bytes::from(format!("{n}"))).await.unwrap()) })
        });
        let mut winners = Vec::new();
        for attempt in attempts {
            let (n, won) = attempt.await.unwrap();
            if won {
                winners.push(n);
            }
        }
        assert_eq!(winners.len(), 1, "{winners:?}");
        assert_eq!(store.get(&k).await.unwrap(), Bytes::from(format!("{}", winners[0])));
    }
}

/// A process killed mid-write (SIGKILL runs no destructor) leaves a temp file: the sweep
/// removes it once idle, and never the file of a writer still writing.
#[tokio::test]
async fn the_directory_stores_sweep_removes_idle_temp_files_only() {
    let dir = tempfile::TempDir::new().unwrap();
    let store = DirStore::open(dir.path()).await.unwrap();
    let mut live = store.writer(&key("up/live")).await.unwrap();
    live.write(Bytes::from_static(b"still ")).await.unwrap();
    let orphan = dir.path().join(".tmp").join("01ORPHANED");
    std::fs::write(&orphan, vec![0u8; 1024]).unwrap();
    let two_hours_ago = SystemTime::now() - Duration::from_secs(2 * 3600);
    std::fs::File::options().write(true).open(&orphan).unwrap().set_modified(two_hours_ago).unwrap();

    assert_eq!(store.sweep_abandoned(ABANDONED_AFTER).await.unwrap(), 1);
    assert!(!orphan.exists());
    live.write(Bytes::from_static(b"writing")).await.unwrap();
    live.finish().await.unwrap();
    assert_eq!(&store.get(&key("up/live")).await.unwrap()[..], b"still writing");
}

/// A multipart upload of a killed writer is found through the marker it left (s3s-fs,
/// like several S3-compatible servers, cannot list uploads) and aborted once old enough.
#[tokio::test]
async fn a_multipart_upload_left_by_a_killed_writer_is_found_and_aborted() {
    let s3 = TestS3::start();
    let store = S3Store::new(s3.settings("sweep"));
    let mut writer = store.writer(&key("big/left")).await.unwrap();
    writer.write(Bytes::from(vec![1u8; 9 * 1024 * 1024])).await.unwrap();
    std::mem::forget(writer);
    assert_eq!(store.list("multipart-uploads/").await.unwrap().len(), 1, "the upload is noted");
    assert_eq!(store.sweep_abandoned(ABANDONED_AFTER).await.unwrap(), 0, "not a day old yet");

    assert_eq!(store.sweep_uploads(Duration::ZERO).await.unwrap(), 1);
    assert!(store.list("multipart-uploads/").await.unwrap().is_empty());
    assert_eq!(store.size(&key("big/left")).await.unwrap(), None);
    // Writers that finish or abort leave no marker behind.
    let mut done = store.writer(&key("big/done")).await.unwrap();
    done.write(Bytes::from(vec![2u8; 9 * 1024 * 1024])).await.unwrap();
    done.finish().await.unwrap();
    let mut aborted = store.writer(&key("big/aborted")).await.unwrap();
    aborted.write(Bytes::from(vec![3u8; 9 * 1024 * 1024])).await.unwrap();
    aborted.abort().await;
    assert!(store.list("multipart-uploads/").await.unwrap().is_empty());
    assert_eq!(store.size(&key("big/done")).await.unwrap(), Some(9 * 1024 * 1024));
}
