//! Which plans and results a device follows.
//!
//! A signature says who wrote a message, not when or for what: a plan the aggregator
//! signed last week, or for another job, verifies as well as today's. So plans and
//! results name their job and run (both signed), and a device follows only its own job and
//! the run its state directory joined. The first plan it accepts binds it to that plan's
//! run; `--rejoin` lets an operator move it to a new run of the job (the aggregator
//! started afresh), which restarts its round count. Within a run, rounds only rise.

/// What to do with a plan or a result, given the run the device follows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Admission {
    /// The run the device follows.
    Follow,
    /// A run to bind to: the device followed none yet, or is told to rejoin.
    Join,
    /// Not for this device, and why.
    Refuse(String),
}

/// Judges a message naming `(job, run)` for a device of `own_job` bound to `bound`;
/// `may_join` lets a plan move a bound device to another run.
pub(crate) fn admit(own_job: &str, bound: Option<u64>, may_join: bool, job: &str, run: u64) -> Admission {
    if job != own_job {
        return Admission::Refuse(format!("it is for job `{job}`, not `{own_job}`"));
    }
    match bound {
        Some(bound) if bound == run => Admission::Follow,
        Some(_) if may_join => Admission::Join,
        Some(bound) => Admission::Refuse(format!(
            "it is from run {run:016x}, and this state directory follows run {bound:016x} \
             (after the aggregator started the job afresh, restart the device with --rejoin)"
        )),
        None => Admission::Join,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_device_follows_only_its_own_job_and_the_run_it_joined() {
        assert_eq!(admit("lab", None, false, "lab", 7), Admission::Join, "a fresh device joins the run it meets");
        assert_eq!(admit("lab", Some(7), false, "lab", 7), Admission::Follow);
        let Admission::Refuse(why) = admit("lab", Some(7), false, "lab", 8) else { panic!("another run is followed") };
        assert!(why.contains("--rejoin") && why.contains("0000000000000008"), "{why}");
        let Admission::Refuse(why) = admit("lab", None, true, "other", 7) else { panic!("another job is followed") };
        assert!(why.contains("job `other`, not `lab`"), "{why}");
        assert_eq!(admit("lab", Some(7), true, "lab", 8), Admission::Join, "--rejoin moves it to the new run");
    }
}
