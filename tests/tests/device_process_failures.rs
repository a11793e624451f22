//! `simulate --processes` names a device process that exits with an error, with its log's
//! last line, instead of leaving the reason in a log the user has to find.

use std::process::Command;

mod common;

#[test]
fn a_device_process_that_fails_at_start_is_named_with_its_reason() {
    let dir = fedpo_tests::TestDir::new();
    // A "device" that fails as a misconfigured one would, before saying hello.
    let fake = dir.path().join("fake-device");
    std::fs::write(&fake, "#!/bin/sh\necho 'error: --state-dir /nope is not writable' >&2\nexit 3\n").unwrap();
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    let out = dir.path().join("job");
    let run = Command::new(common::binary("fedpo-aggregator"))
        .args(["simulate", "--processes", "--devices", "2", "--rounds", "1", "--register-timeout", "5"])
        .arg("--out")
        .arg(&out)
        .env("FEDPO_DEVICE_BIN", &fake)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&run.stderr);
    assert!(!run.status.success(), "{err}");
    assert!(err.contains("device processes failed"), "{err}");
    for device in ["dev-0", "dev-1"] {
        assert!(err.contains(&format!("{device} exited")), "{device}: {err}");
    }
    assert!(err.contains("--state-dir /nope is not writable"), "the log's last line: {err}");
}
