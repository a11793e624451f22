//! Who may connect, publish and subscribe on the embedded broker.
//!
//! Without logins the broker is open (it then listens on loopback only). With logins,
//! every client must give a listed user name and its password, and the same rules as
//! `security/acl` for Mosquitto apply: the administrator (the aggregator's own login)
//! may do anything; any other user is a device, which publishes only on its own uplink
//! `fedpo/{job}/up/{user}` and subscribes only to a job's downlink `fedpo/{job}/down`.
//! So a device that can log in still cannot pose as another device, nor read other
//! devices' uploads, nor publish a plan.

use std::collections::HashMap;

/// No login, an unknown user or a wrong password.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct BadLogin;

#[derive(Debug, Clone, Default)]
pub(super) struct Access {
    /// User name → password; `None` lets anyone in.
    logins: Option<HashMap<String, String>>,
    /// The user with every right.
    admin: Option<String>,
}

/// Compares without stopping at the first difference, so response time says nothing
/// about how much of a guessed password was right.
fn same_secret(a: &str, b: &str) -> bool {
    a.len() == b.len() && a.bytes().zip(b.bytes()).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

impl Access {
    pub(super) fn new(logins: Option<HashMap<String, String>>, admin: Option<String>) -> Self {
        Self { logins, admin }
    }

    /// Checks a CONNECT's login; the user it is, `None` on an open broker.
    pub(super) fn login(&self, login: Option<(&str, &str)>) -> Result<Option<String>, BadLogin> {
        let Some(logins) = &self.logins else { return Ok(None) };
        let (user, password) = login.ok_or(BadLogin)?;
        match logins.get(user) {
            Some(expected) if same_secret(expected, password) => Ok(Some(user.to_string())),
            _ => Err(BadLogin),
        }
    }

    fn is_device<'a>(&self, user: Option<&'a str>) -> Option<&'a str> {
        match (user, &self.admin) {
            (None, _) => None,
            (Some(u), Some(admin)) if u == admin => None,
            (Some(u), _) => Some(u),
        }
    }

    /// Whether `user` may publish on `topic` (a topic name, without wildcards).
    pub(super) fn may_publish(&self, user: Option<&str>, topic: &str) -> bool {
        let Some(device) = self.is_device(user) else { return true };
        matches!(topic.split('/').collect::<Vec<_>>()[..], ["fedpo", job, "up", d] if !job.is_empty() && d == device)
    }

    /// Whether `user` may subscribe to `filter`.
    pub(super) fn may_subscribe(&self, user: Option<&str>, filter: &str) -> bool {
        if self.is_device(user).is_none() {
            return true;
        }
        matches!(filter.split('/').collect::<Vec<_>>()[..], ["fedpo", job, "down"] if !job.is_empty() && job != "#")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fleet() -> Access {
        let logins =
            [("dev-1", "one"), ("dev-2", "two"), ("agg", "secret")].map(|(u, p)| (u.to_string(), p.to_string())).into();
        Access::new(Some(logins), Some("agg".into()))
    }

    #[test]
    fn only_listed_users_with_their_own_password_log_in() {
        let a = fleet();
        assert_eq!(a.login(Some(("dev-1", "one"))), Ok(Some("dev-1".into())));
        assert_eq!(a.login(Some(("dev-1", "two"))), Err(BadLogin));
        assert_eq!(a.login(Some(("dev-1", "on"))), Err(BadLogin));
        assert_eq!(a.login(Some(("dev-9", "one"))), Err(BadLogin));
        assert_eq!(a.login(None), Err(BadLogin));
        assert_eq!(Access::default().login(None), Ok(None));
    }

    #[test]
    fn a_device_publishes_only_on_its_own_uplink_and_reads_only_downlinks() {
        let a = fleet();
        let dev = Some("dev-1");
        assert!(a.may_publish(dev, "fedpo/job/up/dev-1"));
        for topic in ["fedpo/job/up/dev-2", "fedpo/job/down", "fedpo/job/up/dev-1/x", "fedpo//up/dev-1", "other"] {
            assert!(!a.may_publish(dev, topic), "{topic}");
        }
        assert!(a.may_subscribe(dev, "fedpo/job/down"));
        assert!(a.may_subscribe(dev, "fedpo/+/down"));
        for filter in ["fedpo/job/up/+", "fedpo/job/#", "#", "fedpo/#/down", "fedpo/job/down/x"] {
            assert!(!a.may_subscribe(dev, filter), "{filter}");
        }
    }

    #[test]
    fn the_administrator_and_an_open_broker_allow_everything() {
        let a = fleet();
        assert!(a.may_publish(Some("agg"), "fedpo/job/down"));
        assert!(a.may_subscribe(Some("agg"), "fedpo/job/up/+"));
        let open = Access::default();
        assert!(open.may_publish(None, "fedpo/job/up/dev-2"));
        assert!(open.may_subscribe(None, "#"));
    }
}
