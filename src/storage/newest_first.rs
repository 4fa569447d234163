//! Newest-first listings on stores that list only in ascending key order (S3 does).
//!
//! Beside each object listed newest first, an empty marker `<index>/<project>/<name>`
//! whose name sorts in the reverse order of the object's id, so that a newest-first page
//! is one ascending `list_page` of the markers. Ids are time-sortable, so that is
//! creation order, newest first.
//!
//! The name maps each id character to its mirror in a wider alphabet and ends with a
//! character above every mirror, so the reversal also holds for an id that is a prefix
//! of another (`a` < `ab`, so the marker of `ab` sorts before the marker of `a`).

use super::Key;

/// The characters an id may hold, in ascending order.
const ID_CHARS: &[u8; 64] = b"-0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ_abcdefghijklmnopqrstuvwxyz";
/// The characters a key segment may hold, in ascending order: two more than an id's.
const KEY_CHARS: &[u8; 66] = b"-.0123456789=ABCDEFGHIJKLMNOPQRSTUVWXYZ_abcdefghijklmnopqrstuvwxyz";
/// Ends every name: above every mirrored character.
const END: char = 'z';
/// Starts every name, so that no name starts with a dot.
const START: char = 'n';

fn mirror(c: u8) -> Option<u8> {
    let rank = ID_CHARS.iter().position(|&x| x == c)?;
    Some(KEY_CHARS[ID_CHARS.len() - 1 - rank])
}

fn unmirror(c: u8) -> Option<u8> {
    let rank = KEY_CHARS.iter().position(|&x| x == c)?;
    (rank < ID_CHARS.len()).then(|| ID_CHARS[ID_CHARS.len() - 1 - rank])
}

/// The marker's name for `id`, or `None` when `id` holds a character no id may hold.
pub fn name(id: &str) -> Option<String> {
    let mirrored: Option<Vec<u8>> = id.bytes().map(mirror).collect();
    let mirrored = String::from_utf8(mirrored?).expect("ascii");
    Some(format!("{START}{mirrored}{END}"))
}

/// The id a marker's name stands for.
pub fn id(name: &str) -> Option<String> {
    let inner = name.strip_prefix(START)?.strip_suffix(END)?;
    let bytes: Option<Vec<u8>> = inner.bytes().map(unmirror).collect();
    String::from_utf8(bytes?).ok()
}

/// The directory prefix of an index's markers for one owner (`<index>/<owner>/`).
pub fn prefix(index: &str, owner: &str) -> String {
    format!("{index}/{owner}/")
}

/// The marker key of `id` in `index` for `owner`.
pub fn marker(index: &str, owner: &str, id: &str) -> Option<Key> {
    Key::parse(&format!("{}{}", prefix(index, owner), name(id)?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn names_sort_in_reverse_and_map_back(a in "[A-Za-z0-9_-]{1,30}", b in "[A-Za-z0-9_-]{1,30}") {
            let (na, nb) = (name(&a).unwrap(), name(&b).unwrap());
            prop_assert_eq!(a.cmp(&b).reverse(), na.cmp(&nb));
            prop_assert_eq!(id(&na).unwrap(), a);
            prop_assert!(Key::parse(&na).is_some());
        }
    }

    #[test]
    fn prefixes_sort_after_their_extensions() {
        assert!(name("batch_ab").unwrap() < name("batch_a").unwrap());
        assert!(name("file-01").unwrap() > name("file-02").unwrap());
        assert_eq!(name("file.x"), None);
        assert_eq!(id("nothing"), None);
    }
}
