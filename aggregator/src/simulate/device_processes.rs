//! `simulate --processes`: the device processes, watched while the job runs.
//!
//! A device process that exits with an error (a bad flag, a state directory it refuses,
//! a model that does not fit) would otherwise only be noticed when the aggregator gives up
//! waiting for it, with the reason left in its log. The watcher reports each one as it
//! happens, with its log's last line, and the job's error names them.

use std::path::PathBuf;
use std::process::{Child, ExitStatus};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// One device's process and its log.
pub(super) struct DeviceProcess {
    pub(super) id: String,
    pub(super) child: Child,
    pub(super) log: PathBuf,
}

/// The device processes of a simulation and the thread watching them.
pub(super) struct ProcessFleet {
    processes: Arc<Mutex<Vec<DeviceProcess>>>,
    failures: Arc<Mutex<Vec<String>>>,
    stop: Arc<AtomicBool>,
    watcher: Option<JoinHandle<()>>,
}

/// The last non-empty line of a log, for an error message.
fn last_line(log: &PathBuf) -> String {
    std::fs::read_to_string(log)
        .ok()
        .and_then(|text| text.lines().rev().find(|l| !l.trim().is_empty()).map(str::to_string))
        .unwrap_or_else(|| "(its log is empty)".to_string())
}

fn failure(p: &DeviceProcess, status: ExitStatus) -> String {
    format!("{} exited ({status}): {} [{}]", p.id, last_line(&p.log), p.log.display())
}

impl ProcessFleet {
    /// Starts watching `processes`.
    pub(super) fn watch(processes: Vec<DeviceProcess>) -> Self {
        let processes = Arc::new(Mutex::new(processes));
        let failures = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let watcher = {
            let (processes, failures, stop) = (processes.clone(), failures.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut reported = std::collections::HashSet::new();
                while !stop.load(Ordering::SeqCst) {
                    for p in processes.lock().unwrap_or_else(PoisonError::into_inner).iter_mut() {
                        if let Ok(Some(status)) = p.child.try_wait() {
                            if !status.success() && reported.insert(p.id.clone()) {
                                let why = failure(p, status);
                                tracing::error!("device process {why}");
                                failures.lock().unwrap_or_else(PoisonError::into_inner).push(why);
                            }
                        }
                    }
                    std::thread::sleep(Duration::from_millis(250));
                }
            })
        };
        Self { processes, failures, stop, watcher: Some(watcher) }
    }

    /// The device processes that exited with an error so far, each with why.
    pub(super) fn failures(&self) -> Vec<String> {
        self.failures.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// Waits up to `grace` for every process to end, then kills the rest.
    pub(super) fn finish(mut self, grace: Duration) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(w) = self.watcher.take() {
            let _ = w.join();
        }
        let deadline = Instant::now() + grace;
        for p in self.processes.lock().unwrap_or_else(PoisonError::into_inner).iter_mut() {
            while Instant::now() < deadline && matches!(p.child.try_wait(), Ok(None)) {
                std::thread::sleep(Duration::from_millis(50));
            }
            if matches!(p.child.try_wait(), Ok(None)) {
                let _ = p.child.kill();
            }
            let _ = p.child.wait();
        }
    }
}
