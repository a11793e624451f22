//! Cross-crate scenarios live in `tests/tests/*.rs`, one file per theme, each test named
//! after the scenario it proves. This library holds what every scenario shares.

use std::path::{Path, PathBuf};

/// A scenario's working folder: brokers', devices' and the aggregator's files and logs.
/// It is removed when the test passes and kept when the test fails, with its path on
/// stderr, so that a failure's logs can still be read.
#[derive(Debug)]
pub struct TestDir(Option<tempfile::TempDir>);

impl TestDir {
    /// A fresh folder under the system's temporary directory, named `fedpo-test-*`.
    pub fn new() -> Self {
        Self(Some(tempfile::Builder::new().prefix("fedpo-test-").tempdir().expect("a temporary folder")))
    }

    pub fn path(&self) -> &Path {
        self.0.as_ref().expect("present until dropped").path()
    }

    /// Keeps the folder whatever the outcome, and returns its path.
    pub fn keep(mut self) -> PathBuf {
        self.0.take().expect("present until dropped").keep()
    }
}

impl Default for TestDir {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for TestDir {
    fn drop(&mut self) {
        if std::thread::panicking() {
            if let Some(dir) = self.0.take() {
                eprintln!("the failed test's files are kept in {}", dir.keep().display());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_passing_test_leaves_nothing_behind() {
        let dir = TestDir::new();
        let path = dir.path().to_path_buf();
        std::fs::write(path.join("device.log"), "ok").unwrap();
        drop(dir);
        assert!(!path.exists());
    }

    #[test]
    fn a_failing_test_keeps_its_logs() {
        let path = std::thread::spawn(|| {
            let dir = TestDir::new();
            let path = dir.path().to_path_buf();
            std::fs::write(path.join("device.log"), "why it failed").unwrap();
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
                let _dir = dir;
                panic!("the scenario failed");
            }));
            path
        })
        .join()
        .unwrap();
        assert_eq!(std::fs::read_to_string(path.join("device.log")).unwrap(), "why it failed");
        std::fs::remove_dir_all(path).unwrap();
    }
}
