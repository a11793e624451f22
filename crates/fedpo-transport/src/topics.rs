//! The topics of one job.
//!
//! Two directions, one topic each way per device, so that MQTT's per-topic ordering keeps
//! a manifest ahead of its chunks:
//! - `fedpo/{job}/down`: plans, global-model chunks and round results, from the aggregator;
//! - `fedpo/{job}/up/{device}`: hello, updates, update chunks and goodbyes, from one device.
//!
//! A broker ACL can then say "a device publishes only under its own `up/` topic and reads
//! only `down`".

/// Topic names for a job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Topics {
    job: String,
}

impl Topics {
    /// Topics of `job`. MQTT wildcards and separators in the name are refused.
    pub fn new(job: &str) -> std::result::Result<Self, String> {
        check_segment("job", job)?;
        Ok(Self { job: job.to_string() })
    }

    /// The job name.
    pub fn job(&self) -> &str {
        &self.job
    }

    /// Aggregator to devices.
    pub fn down(&self) -> String {
        format!("fedpo/{}/down", self.job)
    }

    /// One device to the aggregator.
    pub fn up(&self, device: &str) -> String {
        format!("fedpo/{}/up/{device}", self.job)
    }

    /// Every device's uplink (a subscription filter).
    pub fn up_all(&self) -> String {
        format!("fedpo/{}/up/+", self.job)
    }

    /// Everything of the job (a subscription filter, e.g. for a wiretap).
    pub fn all(&self) -> String {
        format!("fedpo/{}/#", self.job)
    }

    /// The device an uplink topic belongs to, if it is one.
    pub fn device_of<'a>(&self, topic: &'a str) -> Option<&'a str> {
        topic.strip_prefix("fedpo/")?.strip_prefix(self.job.as_str())?.strip_prefix("/up/")
    }
}

/// Checks that an id can stand as one topic level.
pub(crate) fn check_segment(what: &str, s: &str) -> std::result::Result<(), String> {
    if s.is_empty() || s.len() > 128 {
        return Err(format!("{what} `{s}` must be 1 to 128 bytes long"));
    }
    if let Some(c) = s.chars().find(|c| matches!(c, '/' | '+' | '#' | '\0') || c.is_whitespace()) {
        return Err(format!("{what} `{s}` contains `{c}`, which MQTT topics reserve"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uplink_topic_names_its_device_and_downlink_does_not() {
        let t = Topics::new("demo").unwrap();
        assert_eq!(t.up("dev-3"), "fedpo/demo/up/dev-3");
        assert_eq!(t.device_of(&t.up("dev-3")), Some("dev-3"));
        assert_eq!(t.device_of(&t.down()), None);
        assert_eq!(Topics::new("other").unwrap().device_of(&t.up("dev-3")), None);
    }

    #[test]
    fn wildcards_in_names_are_refused() {
        for bad in ["a/b", "a+", "#", "", "a b"] {
            assert!(Topics::new(bad).is_err(), "{bad:?}");
        }
    }
}
