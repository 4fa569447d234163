//! What each pending upload holds, kept in memory so that adding a part costs the same
//! however many parts the upload has: the parts begun (finished or being received) and
//! the bytes of the finished ones. A process learns an upload's tally from one listing
//! of its parts, the first time it receives a part of it, and keeps it up to date from
//! then on. With several api replicas, each counts what it has seen besides that
//! listing; a completion checks the parts it names against storage, exactly.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::clock::UnixSeconds;
use crate::ids::UploadId;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Tally {
    /// Parts finished or being received.
    pub parts: usize,
    /// Bytes of the finished parts.
    pub bytes: u64,
    /// When the upload stops taking parts: its tally is forgotten after.
    pub expires_at: UnixSeconds,
}

#[derive(Clone, Debug, Default)]
pub struct Tallies(Arc<Mutex<HashMap<UploadId, Tally>>>);

/// Why a part could not begin.
#[derive(Debug, PartialEq, Eq)]
pub enum Full {
    Parts,
}

impl Tallies {
    /// The upload's tally, if this process knows it.
    pub fn get(&self, upload: &UploadId) -> Option<Tally> {
        self.lock().get(upload).copied()
    }

    /// Learns an upload's tally from storage (kept if another part learned it first).
    pub fn learn(&self, upload: &UploadId, tally: Tally) {
        self.lock().entry(upload.clone()).or_insert(tally);
    }

    /// Begins a part of `upload` if it has fewer than `max_parts`: the room its finished
    /// parts leave of `size`, and the slot, given back unless the part finishes.
    pub fn begin(&self, upload: &UploadId, max_parts: usize, size: u64) -> Result<(u64, PartSlot), Full> {
        let mut tallies = self.lock();
        let tally = tallies.get_mut(upload).expect("learned before a part begins");
        if tally.parts >= max_parts {
            return Err(Full::Parts);
        }
        tally.parts += 1;
        let room = size.saturating_sub(tally.bytes);
        Ok((room, PartSlot { tallies: self.clone(), upload: upload.clone(), finished: false }))
    }

    /// Forgets an upload (completed, cancelled).
    pub fn forget(&self, upload: &UploadId) {
        self.lock().remove(upload);
    }

    /// Forgets the uploads that stopped taking parts before `now`.
    pub fn forget_expired(&self, now: UnixSeconds) {
        self.lock().retain(|_, tally| tally.expires_at > now);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<UploadId, Tally>> {
        self.0.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// A part being received, counted in its upload's tally.
#[derive(Debug)]
pub struct PartSlot {
    tallies: Tallies,
    upload: UploadId,
    finished: bool,
}

impl PartSlot {
    /// The part is finished with `bytes`: it counts for good.
    pub fn finish(mut self, bytes: u64) {
        self.finished = true;
        if let Some(tally) = self.tallies.lock().get_mut(&self.upload) {
            tally.bytes += bytes;
        }
    }
}

impl Drop for PartSlot {
    fn drop(&mut self) {
        if !self.finished
            && let Some(tally) = self.tallies.lock().get_mut(&self.upload)
        {
            tally.parts = tally.parts.saturating_sub(1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn upload() -> UploadId {
        UploadId::generate()
    }

    #[test]
    fn parts_count_until_the_most_and_leave_the_room_their_bytes_leave() {
        let (tallies, id) = (Tallies::default(), upload());
        tallies.learn(&id, Tally { parts: 1, bytes: 10, expires_at: 100 });
        let (room, first) = tallies.begin(&id, 3, 50).unwrap();
        assert_eq!(room, 40);
        first.finish(15);
        let (room, _second) = tallies.begin(&id, 3, 50).unwrap();
        assert_eq!(room, 25, "finished parts' bytes count");
        assert_eq!(tallies.begin(&id, 3, 50).unwrap_err(), Full::Parts, "a part being received counts");
    }

    #[test]
    fn a_part_that_does_not_finish_gives_its_slot_back() {
        let (tallies, id) = (Tallies::default(), upload());
        tallies.learn(&id, Tally { parts: 0, bytes: 0, expires_at: 100 });
        let (_, slot) = tallies.begin(&id, 1, 50).unwrap();
        assert!(tallies.begin(&id, 1, 50).is_err());
        drop(slot);
        let (room, _) = tallies.begin(&id, 1, 50).unwrap();
        assert_eq!(room, 50);
    }

    #[test]
    fn a_tally_learned_twice_keeps_the_first_and_expired_ones_are_forgotten() {
        let (tallies, id, other) = (Tallies::default(), upload(), upload());
        tallies.learn(&id, Tally { parts: 2, bytes: 5, expires_at: 100 });
        tallies.learn(&id, Tally { parts: 0, bytes: 0, expires_at: 100 });
        assert_eq!(tallies.get(&id).unwrap().parts, 2);
        tallies.learn(&other, Tally { parts: 0, bytes: 0, expires_at: 200 });
        tallies.forget_expired(150);
        assert_eq!((tallies.get(&id), tallies.get(&other).is_some()), (None, true));
    }
}
