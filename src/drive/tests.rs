//! `drive` against a runtime that only records what it is asked: one pass, from what the
//! runtime says runs and what the shards' checkpoints hold, to the workers started,
//! stopped and retired, the states saved and the news told.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::*;
use crate::batches::BatchSpec;
use crate::exec::ExecSettings;
use crate::exec::upstream::Upstreams;
use crate::files::FileCatalog;
use crate::quota::QuotaLedger;
use crate::storage::DirStore;
use crate::validate::ShardPlan;

/// A case: its name, the batch, the workers the runtime knows of, its free slots, what
/// the pass should ask of it and when it should come back.
type Case = (&'static str, Batch, Vec<(u32, WorkerPhase)>, Option<usize>, Vec<Call>, Next);

/// What the runtime was asked, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Call {
    Start(u32),
    Stop(u32),
    Retire(u32),
    Save(Status),
    Tell(News),
}

struct Fake {
    workers: BTreeMap<u32, WorkerPhase>,
    slots: Option<usize>,
    calls: Mutex<Vec<Call>>,
}

#[async_trait]
impl Runtime for Fake {
    type Error = ExecError;

    async fn workers(&self, _batch: &Batch) -> Result<BTreeMap<u32, WorkerPhase>, ExecError> {
        Ok(self.workers.clone())
    }
    fn free_slots(&self, _batch: &Batch) -> Option<usize> {
        self.slots
    }
    async fn start(&self, _batch: &Batch, shard: &Shard) -> Result<(), ExecError> {
        self.calls.lock().unwrap().push(Call::Start(shard.index));
        Ok(())
    }
    async fn stop(&self, _batch: &Batch, shard: u32) -> Result<(), ExecError> {
        self.calls.lock().unwrap().push(Call::Stop(shard));
        Ok(())
    }
    async fn retire(&self, _batch: &Batch, shard: u32) -> Result<(), ExecError> {
        self.calls.lock().unwrap().push(Call::Retire(shard));
        Ok(())
    }
    async fn save(&self, read: &Batch, state: BatchState) -> Result<Option<Batch>, ExecError> {
        self.calls.lock().unwrap().push(Call::Save(state.status));
        Ok(Some(Batch { spec: read.spec.clone(), state }))
    }
    async fn tell(&self, _batch: &Batch, news: News) {
        self.calls.lock().unwrap().push(Call::Tell(news));
    }
}

/// A batch of `shards` shards of 10 lines each, none recorded, expiring in an hour.
fn batch(shards: u32, status: Status, failures: &[(u32, u32)]) -> Batch {
    let now = clock::now();
    let spec = BatchSpec::sample(ShardPlan::of_sizes(&vec![10; shards as usize]), now, now + 3600);
    let mut state = BatchState::in_progress(now, 10 * u64::from(shards));
    state.status = status;
    state.shard_failures = failures.iter().copied().collect();
    Batch { spec, state }
}

async fn exec(dir: &tempfile::TempDir) -> ExecContext {
    let store: Arc<dyn crate::storage::ObjectStore> = Arc::new(DirStore::open(dir.path()).await.unwrap());
    let files = FileCatalog::new(store.clone(), Duration::from_secs(3600));
    let settings = ExecSettings { max_shard_retries: 2, ..ExecSettings::default() };
    ExecContext::new(store, files, Upstreams::echo_only(), Arc::new(QuotaLedger::default()), settings)
}

/// `batch` given an input of 10 lines a shard in storage, and the plan validation makes
/// of it (a drain reads the lines it gives records).
async fn with_input(exec: &ExecContext, mut batch: Batch) -> Batch {
    let lines = batch.spec.plan.shards.len() * 10;
    let input: String = (0..lines)
        .map(|n| format!("{{\"custom_id\":\"r{n}\",\"method\":\"POST\",\"url\":\"/v1/chat/completions\",\"body\":{{\"model\":\"m\",\"messages\":[]}}}}\n"))
        .collect();
    let mut upload = exec.files.start_upload(&batch.spec.project_id).await.unwrap();
    upload.write(bytes::Bytes::from(input.clone())).await.unwrap();
    let new = crate::files::NewFile {
        filename: None,
        purpose: crate::files::Purpose::Batch,
        is_error: false,
        expires_after: None,
    };
    batch.spec.input_file_id = upload.commit(new).await.unwrap().id;
    batch.spec.plan = crate::validate::validate(input.as_bytes(), "/v1/chat/completions", 10).unwrap().shards;
    batch
}

#[tokio::test]
async fn one_pass_asks_the_runtime_for_what_the_decision_needs() {
    use Call::*;
    use WorkerPhase::{Failed, Running, Succeeded};
    let retried = News::ShardRetried { shard: 1, failures: 1 };
    let gave_up = News::ShardGaveUp { shard: 1, failures: 3 };
    #[rustfmt::skip]
    let cases: Vec<Case> = vec![
        ("a new batch starts a worker per shard", batch(3, Status::InProgress, &[]), vec![], None,
         vec![Start(0), Start(1), Start(2)], Next::AtPace),
        ("as many as the runtime has room for", batch(3, Status::InProgress, &[]), vec![], Some(1),
         vec![Start(0)], Next::AtPace),
        ("shards that run are not started again", batch(3, Status::InProgress, &[]),
         vec![(0, Running), (1, Running)], None, vec![Start(2)], Next::AtPace),
        ("a worker that ran stands until it is gone: its shard is not started", batch(2, Status::InProgress, &[]),
         vec![(0, Running), (1, Succeeded)], None, vec![], Next::AtPace),
        ("a failed worker is counted, retired and told; its shard starts on a later pass",
         batch(2, Status::InProgress, &[]), vec![(0, Running), (1, Failed)], None,
         vec![Save(Status::InProgress), Retire(1), Tell(retried)], Next::AtPace),
        ("past the retry budget its shard is given up, not started", batch(2, Status::InProgress, &[(1, 2)]),
         vec![(0, Running), (1, Failed)], None,
         vec![Save(Status::InProgress), Retire(1), Tell(gave_up)], Next::AtPace),
        ("cancelling stops what runs", batch(2, Status::Cancelling, &[]),
         vec![(0, Running), (1, Running)], None, vec![Stop(0), Stop(1), Tell(News::Stopping)], Next::Shortly),
        ("a terminal batch asks for nothing", batch(2, Status::Completed, &[]),
         vec![(0, Running)], None, vec![], Next::Done),
    ];
    for (name, batch, workers, slots, expected, next) in cases {
        let dir = tempfile::TempDir::new().unwrap();
        let exec = exec(&dir).await;
        let runtime = Fake { workers: workers.into_iter().collect(), slots, calls: Mutex::new(Vec::new()) };
        let got = drive(&runtime, &exec, with_input(&exec, batch).await).await.unwrap();
        assert_eq!((runtime.calls.into_inner().unwrap(), got), (expected, next), "{name}");
    }
}

#[tokio::test]
async fn a_cancelled_batch_with_nothing_running_is_drained_then_finalized() {
    let dir = tempfile::TempDir::new().unwrap();
    let exec = exec(&dir).await;
    let runtime = Fake { workers: BTreeMap::new(), slots: None, calls: Mutex::new(Vec::new()) };
    let cancelling = with_input(&exec, batch(3, Status::Cancelling, &[])).await;
    // The first pass gives every line a cancelled record, the next one finalizes.
    assert_eq!(drive(&runtime, &exec, cancelling.clone()).await.unwrap(), Next::Now);
    assert!(runtime.calls.lock().unwrap().is_empty(), "draining asks the runtime for nothing");
    assert_eq!(drive(&runtime, &exec, cancelling).await.unwrap(), Next::Done);
    let calls = runtime.calls.into_inner().unwrap();
    let to = Status::Cancelled;
    let told = [Call::Tell(News::StatusChanged { from: Status::Cancelling, to }), Call::Tell(News::Finished)];
    // The drained lines' counts saved, the output files' ids reserved, then the terminal
    // state saved and told.
    let saved = [Call::Save(Status::Cancelling), Call::Save(Status::Cancelling), Call::Save(to)];
    assert_eq!(calls, [&saved[..], &told].concat());
}
