//! Who is in the job: devices saying hello (registration, restarts, two processes
//! claiming one id) and goodbye, and waiting until enough of them are online.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use fedpo_wire::device_tag::{self, Tagged};
use fedpo_wire::{DeviceBye, DeviceHello};

use super::identity::Claim;
use super::{Aggregator, OpenRound};
use crate::checkpoint::DeviceRecord;

impl Aggregator {
    /// Declares the fleet closed: `devices` devices, none joining later and none returning
    /// after a goodbye of its own (a simulation's). When all of them have left, the job
    /// fails with their reasons instead of waiting for devices that will not come.
    pub(crate) fn close_fleet(&mut self, devices: usize) {
        self.closed_fleet = Some(devices);
    }

    /// The error to stop with when every device of a closed fleet has said goodbye.
    fn fleet_gone(&self) -> Option<anyhow::Error> {
        let fleet = self.closed_fleet?;
        if fleet == 0 || self.farewells.len() < fleet {
            return None;
        }
        let mut reasons: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
        for (device, reason) in &self.farewells {
            reasons.entry(reason.as_str()).or_default().push(device.as_str());
        }
        let said = reasons.iter().map(|(reason, devices)| format!("{}: {reason}", devices.join(", ")));
        let who = if fleet == 1 { "the only device".to_string() } else { format!("all {fleet} devices") };
        Some(anyhow::anyhow!("{who} left the job. {}", said.collect::<Vec<_>>().join("; ")))
    }

    /// The embedded broker's logins (user → password): only these devices may join,
    /// when no --devices-file says otherwise, and each must tag its hellos and goodbyes
    /// with its password, since that broker lets any client publish under any topic.
    pub(crate) fn authenticate_devices(&mut self, logins: std::collections::HashMap<String, String>) {
        self.allowed.get_or_insert_with(|| logins.keys().cloned().collect());
        self.device_passwords = Some(logins);
    }

    /// Whether `message` from `device` carries its login's tag (true without logins).
    fn authentic<M: Tagged>(&self, device: &str, message: &M) -> bool {
        self.device_passwords
            .as_ref()
            .is_none_or(|logins| logins.get(device).is_some_and(|password| device_tag::verify(message, password)))
    }

    pub(super) fn online(&self) -> Vec<String> {
        self.state.devices.iter().filter(|(_, d)| d.online).map(|(id, _)| id.clone()).collect()
    }

    /// Waits until --min-devices are online (or, with none given, the devices known from a
    /// checkpoint or at least one), up to --register-timeout.
    pub(super) fn wait_for_devices(&mut self) -> Result<()> {
        let want = self.job.min_devices.unwrap_or(1).max(1);
        let deadline = Instant::now() + Duration::from_secs(self.job.register_timeout);
        let mut last_report = Instant::now();
        while self.online().len() < want {
            if let Some(gone) = self.fleet_gone() {
                return Err(gone);
            }
            if Instant::now() > deadline {
                bail!(
                    "only {} of the {want} devices needed registered within --register-timeout {} s",
                    self.online().len(),
                    self.job.register_timeout
                );
            }
            if last_report.elapsed() > Duration::from_secs(10) {
                tracing::info!(online = self.online().len(), want, "waiting for devices");
                last_report = Instant::now();
            }
            self.poll(Duration::from_millis(200), None)?;
        }
        Ok(())
    }

    /// A device's hello: it registers, comes back after a restart or a lost connection
    /// (and then gets the open round's plan again), or turns out to share its id with
    /// another process.
    pub(super) fn on_hello(&mut self, device: String, h: DeviceHello, open: Option<&mut OpenRound>) -> Result<()> {
        if h.device != device {
            self.warnings.warn(&device, "hello", &format!("hello names device `{}`; ignored", h.device));
            return Ok(());
        }
        if !self.authentic(&device, &h) {
            self.warnings.warn(&device, "hello", "hello without this device's login tag; ignored");
            return Ok(());
        }
        if !self.state.devices.contains_key(&device) {
            if self.allowed.as_ref().is_some_and(|ids| !ids.contains(&device)) {
                self.warnings.warn(&device, "hello", "hello from a device not allowed in the job; ignored");
                return Ok(());
            }
            if self.state.devices.len() >= self.job.max_devices {
                let why = format!("hello from a new device beyond --max-devices {}; ignored", self.job.max_devices);
                self.warnings.warn(&device, "hello", &why);
                return Ok(());
            }
        }
        match self.identities.observe(&device, h.instance) {
            Claim::Conflicted => return Ok(()),
            Claim::Conflict(a, b) => {
                tracing::error!(
                    %device,
                    instances = format_args!("{a:016x} and {b:016x}"),
                    "two devices claim this id; it is left out of the job (give each device its own --id)"
                );
                if let Some(d) = self.state.devices.get_mut(&device) {
                    d.online = false;
                }
                if let Some(open) = open {
                    open.transfers.remove(&device);
                    open.collector.conflicted(&device);
                }
                return Ok(());
            }
            Claim::Restarted => tracing::info!(%device, "device restarted"),
            Claim::Known => {}
        }
        let previous = self.state.devices.get(&device);
        let known = previous.is_some_and(|d| d.online);
        // A new connection number: the device was cut off, and what was published
        // to it meanwhile (the plan, chunks) may be lost.
        let reconnected = previous.is_some_and(|d| d.connection != h.connection);
        if !known {
            tracing::info!(%device, pairs = h.pairs, backend = %h.backend, "device registered");
        }
        self.farewells.remove(&device);
        let holds = hex::encode(&h.model);
        let record = DeviceRecord { pairs: h.pairs, backend: h.backend, online: true, connection: h.connection, holds };
        self.state.devices.insert(device.clone(), record);
        if let Some(open) = open {
            if open.collector.asks_again(&device, reconnected, Instant::now()) {
                tracing::info!(%device, reconnected, "device asked again; resending the plan and model");
                self.publish_plan(open)?;
            }
        }
        Ok(())
    }

    /// A device's goodbye, or the broker's last will for it.
    pub(super) fn on_bye(&mut self, device: String, b: &DeviceBye) {
        if !self.authentic(&device, b) {
            self.warnings.warn(&device, "bye", "goodbye without this device's login tag; ignored");
            return;
        }
        if b.instance != 0 && self.identities.current(&device).is_some_and(|current| current != b.instance) {
            // The last will of a process the device has since replaced, say.
            tracing::debug!(%device, instance = b.instance, "goodbye from an earlier instance; ignored");
            return;
        }
        if b.is_deliberate() {
            self.farewells.insert(device.clone(), b.reason.clone());
        }
        if let Some(d) = self.state.devices.get_mut(&device) {
            if d.online {
                tracing::warn!(%device, reason = %b.reason, "device offline");
            }
            d.online = false;
        }
    }
}
