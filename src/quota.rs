//! Token quotas: how much each project has used, per batch, and whether it has room.
//!
//! Usage is known two ways: live, as workers see lines succeed, and durably, from
//! the checkpoints that the reconcile loop reads (and from batch documents after a
//! restart). For each batch the ledger keeps the larger of the two, so a restart
//! neither loses committed usage nor counts a line twice.
//!
//! A Kubernetes worker of a project with a quota holds a [`QuotaLedger::granted`]
//! ledger instead: it may spend what the controller allows it (`crate::grants`), and
//! when that is spent it waits for more, until the controller says the project's quota
//! is exhausted.

use std::collections::HashMap;
use std::sync::Mutex;

use tokio::sync::watch;

use crate::ids::{BatchId, ProjectId};
use crate::projects::Projects;

#[derive(Default)]
struct ProjectUsage {
    total: u64,
    by_batch: HashMap<BatchId, u64>,
    /// Usage known for the project as a whole (a Project resource's status).
    floor: u64,
}

#[derive(Default)]
pub struct QuotaLedger {
    limits: Mutex<HashMap<ProjectId, u64>>,
    used: Mutex<HashMap<ProjectId, ProjectUsage>>,
    granted: Option<Granted>,
    /// Lines charged so far: with the tokens, what a line costs on average.
    lines: std::sync::atomic::AtomicU64,
}

/// A worker's allowance from the controller: tokens it may spend in all, and whether
/// the project has none left to give.
struct Granted {
    allowance: watch::Sender<(u64, bool)>,
}

/// Whether a line may be sent now, as far as tokens go.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Room {
    Yes,
    /// Not now: the worker's allowance is spent, more may come.
    Wait,
    /// The project's quota is used up.
    No,
}

impl QuotaLedger {
    pub fn new(projects: &Projects) -> Self {
        let ledger = Self::default();
        ledger.set_limits(projects);
        ledger
    }

    /// A ledger for one project that may use `limit` more tokens (a worker's view).
    pub fn single(project: &ProjectId, limit: Option<u64>) -> Self {
        Self { limits: Mutex::new(limit.map(|l| (project.clone(), l)).into_iter().collect()), ..Self::default() }
    }

    /// A worker's ledger that spends only what it is granted, nothing until then.
    pub fn granted() -> Self {
        Self { granted: Some(Granted { allowance: watch::Sender::new((0, false)) }), ..Self::default() }
    }

    /// Whether this ledger spends grants.
    pub fn is_granted(&self) -> bool {
        self.granted.is_some()
    }

    /// Takes a new grant: `allowance` tokens in all; `exhausted`: no more will come.
    pub fn grant(&self, allowance: u64, exhausted: bool) {
        if let Some(granted) = &self.granted {
            granted.allowance.send_if_modified(|current| {
                let changed = *current != (allowance, exhausted);
                *current = (allowance, exhausted);
                changed
            });
        }
    }

    /// Changes of the grant, for a worker waiting for more (`None` without grants).
    pub fn grants(&self) -> Option<watch::Receiver<(u64, bool)>> {
        self.granted.as_ref().map(|granted| granted.allowance.subscribe())
    }

    /// Tokens charged so far by this process, over every project.
    pub fn spent(&self) -> u64 {
        self.used.lock().expect("quota ledger").values().map(|usage| usage.total).sum()
    }

    /// A granted ledger whose allowance is spent, waiting for more.
    pub fn waiting(&self) -> bool {
        self.granted.as_ref().is_some_and(|granted| {
            let (allowance, exhausted) = *granted.allowance.borrow();
            self.spent() >= allowance && !exhausted
        })
    }

    /// Whether a line of `project` may be sent now, with `in_flight` lines of this
    /// worker not answered yet. A granted ledger counts each line in flight at what a
    /// line has cost so far (so that its lines in flight together stay within the
    /// allowance), and sends its first line alone, to learn that cost.
    pub fn room(&self, project: &ProjectId, in_flight: usize) -> Room {
        let Some(granted) = &self.granted else {
            return if self.has_room(project) { Room::Yes } else { Room::No };
        };
        let (allowance, exhausted) = *granted.allowance.borrow();
        let spent = self.spent();
        let lines = self.lines.load(std::sync::atomic::Ordering::Relaxed);
        let reserved = match lines {
            0 if in_flight > 0 => return Room::Wait,
            0 => 0,
            lines => in_flight as u64 * spent.div_ceil(lines),
        };
        if spent.saturating_add(reserved) < allowance {
            Room::Yes
        } else if exhausted && in_flight == 0 {
            Room::No
        } else {
            // More may be granted, or the lines in flight may cost less than counted.
            Room::Wait
        }
    }

    /// Takes the quotas of `projects` (they changed).
    pub fn set_limits(&self, projects: &Projects) {
        *self.limits.lock().expect("quota limits") = projects.quotas().collect();
    }

    /// Durable: the project is known to have used `tokens` in all.
    pub fn observe_project(&self, project: &ProjectId, tokens: u64) {
        let mut used = self.used.lock().expect("quota ledger");
        let usage = used.entry(project.clone()).or_default();
        usage.floor = usage.floor.max(tokens);
    }

    /// Durable: the project's finished batches used `tokens` (they charge no more).
    pub fn settle(&self, project: &ProjectId, tokens: u64) {
        self.used.lock().expect("quota ledger").entry(project.clone()).or_default().total += tokens;
    }

    /// Tokens the project has used, over all its batches.
    pub fn used(&self, project: &ProjectId) -> u64 {
        self.used.lock().expect("quota ledger").get(project).map_or(0, |usage| usage.total.max(usage.floor))
    }

    /// Whether the project may spend more tokens (always, without a quota).
    pub fn has_room(&self, project: &ProjectId) -> bool {
        let limit = self.limits.lock().expect("quota limits").get(project).copied();
        limit.is_none_or(|limit| self.used(project) < limit)
    }

    /// Live: a line of `batch` just used `tokens`.
    pub fn charge(&self, project: &ProjectId, batch: &BatchId, tokens: u64) {
        self.lines.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mut used = self.used.lock().expect("quota ledger");
        // Called once per line: look up before cloning keys into the maps.
        if !used.contains_key(project) {
            used.insert(project.clone(), ProjectUsage::default());
        }
        let usage = used.get_mut(project).expect("inserted above");
        match usage.by_batch.get_mut(batch) {
            Some(known) => *known += tokens,
            None => {
                usage.by_batch.insert(batch.clone(), tokens);
            }
        }
        usage.total += tokens;
    }

    /// Durable: `batch` is known to have used `tokens` in all.
    pub fn observe(&self, project: &ProjectId, batch: &BatchId, tokens: u64) {
        let mut used = self.used.lock().expect("quota ledger");
        let usage = used.entry(project.clone()).or_default();
        let known = usage.by_batch.entry(batch.clone()).or_default();
        if tokens > *known {
            usage.total += tokens - *known;
            *known = tokens;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{ApiKeyConfig, ProjectConfig, QuotaConfig, Weight};

    #[test]
    fn live_and_durable_usage_merge_without_double_counting() {
        let project = ProjectId::generate();
        let projects = Projects::from_config(&[ProjectConfig {
            id: project.clone(),
            name: None,
            api_keys: vec![ApiKeyConfig::plain("k")],
            quota: Some(QuotaConfig { tokens: 100 }),
            rate_limit: None,
            webhooks: Vec::new(),
            weight: Weight::default(),
        }]);
        let ledger = QuotaLedger::new(&projects);
        let (a, b) = (BatchId::generate(), BatchId::generate());
        ledger.observe(&project, &a, 40);
        ledger.charge(&project, &a, 10);
        ledger.observe(&project, &a, 45);
        assert_eq!(ledger.used(&project), 50, "durable 45 is behind live 50");
        ledger.observe(&project, &a, 60);
        ledger.charge(&project, &b, 30);
        assert_eq!(ledger.used(&project), 90);
        assert!(ledger.has_room(&project));
        ledger.charge(&project, &b, 10);
        assert!(!ledger.has_room(&project));
        assert!(ledger.has_room(&ProjectId::generate()), "no quota, no limit");
    }

    #[test]
    fn a_granted_ledger_waits_for_grants_and_fails_only_once_exhausted() {
        let (project, batch) = (ProjectId::generate(), BatchId::generate());
        let ledger = QuotaLedger::granted();
        let mut grants = ledger.grants().unwrap();
        assert_eq!(ledger.room(&project, 0), Room::Wait, "nothing before the first grant");
        ledger.grant(10, false);
        assert!(grants.has_changed().unwrap());
        assert_eq!(ledger.room(&project, 0), Room::Yes);
        assert_eq!(ledger.room(&project, 1), Room::Wait, "the first line goes alone");
        ledger.charge(&project, &batch, 12);
        assert_eq!((ledger.spent(), ledger.room(&project, 0)), (12, Room::Wait), "spent past it: wait for more");
        grants.mark_unchanged();
        ledger.grant(40, false);
        // 12 a line: two in flight count 24 more.
        assert_eq!(ledger.room(&project, 2), Room::Yes, "12 + 24 < 40");
        assert_eq!(ledger.room(&project, 3), Room::Wait, "12 + 36 > 40");
        ledger.grant(40, true);
        assert!(grants.has_changed().unwrap());
        assert_eq!(ledger.room(&project, 3), Room::Wait, "exhausted, but lines in flight may cost less");
        ledger.charge(&project, &batch, 30);
        assert_eq!(ledger.room(&project, 0), Room::No, "exhausted");
        assert_eq!(QuotaLedger::single(&project, Some(0)).room(&project, 0), Room::No, "serve never waits");
    }
}
