//! A device that speaks the protocol but sends what a test tells it to: NaN, stale or
//! corrupted updates, or half an upload.

use std::time::{Duration, Instant};

use fedpo_transport::{BrokerUrl, LinkEvent, LinkOptions, MqttLink, Topics};
use fedpo_wire::{
    split_payload, DeviceBye, DeviceHello, Limits, Message, RoundDeclined, RoundPlan, SecAggMessage, TensorPayload,
    ToWire, TransferChunk, Update, UpdateMetrics, WireDType, DEFAULT_CHUNK_BYTES,
};

/// A tensor the fake device makes up.
struct Made(String, Vec<u64>, Vec<f32>);

impl ToWire for Made {
    fn wire_name(&self) -> &str {
        &self.0
    }
    fn wire_shape(&self) -> Vec<u64> {
        self.1.clone()
    }
    fn wire_values(&self) -> &[f32] {
        &self.2
    }
}

pub struct FakeDevice {
    link: MqttLink,
    topics: Topics,
    id: String,
    instance: u64,
    /// Its broker password, which tags its hellos.
    password: Option<String>,
    /// Digest of the model of the last plan it answered with an update, which its hellos
    /// say it holds, as a real device's do.
    holds: std::sync::Mutex<Vec<u8>>,
}

impl FakeDevice {
    /// Connects as `id` in `job`, with the last will a real device leaves (a goodbye the
    /// broker publishes if the connection dies).
    pub fn join(url: &BrokerUrl, job: &str, id: &str) -> Self {
        let topics = Topics::new(job).unwrap();
        let mut opts = LinkOptions::new(format!("fake-{id}"));
        let instance = rand::random::<u64>().max(1);
        let mut will = DeviceBye::last_will(id).from_instance(instance);
        if let Some(password) = &url.password {
            fedpo_wire::device_tag::tag(&mut will, password);
        }
        opts.last_will = Some((topics.up(id), Message::Bye(will).encode()));
        let link = MqttLink::connect(url, &opts).unwrap();
        link.subscribe(&topics.down()).unwrap();
        Self { link, topics, id: id.into(), instance, password: url.password.clone(), holds: Default::default() }
    }

    /// Joins every id at once and waits for the plan that selects each: they say hello
    /// concurrently, as a job's `--min-devices` needs them all before it plans.
    pub fn join_all<const N: usize>(
        url: &BrokerUrl,
        job: &'static str,
        ids: [&'static str; N],
    ) -> [(Self, RoundPlan); N] {
        ids.map(|id| {
            let url = url.clone();
            std::thread::spawn(move || {
                let device = Self::join(&url, job, id);
                let plan = device.plan();
                (device, plan)
            })
        })
        .map(|waiting| waiting.join().unwrap())
    }

    /// The next plan that selects this device, saying hello every 2 s meanwhile (the
    /// aggregator may not be listening yet), as a real device does.
    pub fn plan(&self) -> RoundPlan {
        let mut hello = DeviceHello {
            device: self.id.clone(),
            pairs: 4,
            backend: "cpu".into(),
            memory_mb: 0,
            instance: self.instance,
            connection: 1,
            model: self.holds.lock().unwrap().clone(),
            tag: Vec::new(),
        };
        if let Some(password) = &self.password {
            fedpo_wire::device_tag::tag(&mut hello, password);
        }
        let hello = Message::Hello(hello);
        let deadline = Instant::now() + Duration::from_secs(120);
        let mut last_hello: Option<Instant> = None;
        while Instant::now() < deadline {
            if last_hello.is_none_or(|t| t.elapsed() > Duration::from_secs(2)) {
                self.link.publish(&self.topics.up(&self.id), hello.encode()).unwrap();
                last_hello = Some(Instant::now());
            }
            if let Ok(Some(LinkEvent::Message(d))) = self.link.recv_timeout(Duration::from_millis(100)) {
                if let Ok(Message::Plan(p)) = Message::decode(&d.payload, &Limits::default()) {
                    if p.selected.contains(&self.id) {
                        return p;
                    }
                }
            }
        }
        panic!("no plan selected {}", self.id);
    }

    /// An update for `round` shaped like the plan's shared set (embeddings frozen), every
    /// value `value`, announced and split into chunks.
    pub fn prepare(&self, plan: &RoundPlan, round: u64, value: f32) -> (Update, Vec<TransferChunk>) {
        let tensors: Vec<Made> = plan
            .global_model
            .tensors
            .iter()
            .filter(|t| !t.name.starts_with("wte.") && !t.name.starts_with("wpe."))
            .map(|t| Made(t.name.clone(), t.shape.clone(), vec![value; t.shape.iter().product::<u64>() as usize]))
            .collect();
        let payload = TensorPayload::encode(&tensors, WireDType::F32);
        let (manifest, chunks) = split_payload(&format!("r{round}/{}", self.id), &payload, DEFAULT_CHUNK_BYTES);
        let metrics = UpdateMetrics {
            train_loss: 0.5,
            reward_acc: 0.5,
            heldout_acc: None,
            grad_norm: 1.0,
            seconds: 0.1,
            peak_rss_mib: None,
        };
        let update = Update {
            round,
            device: self.id.clone(),
            pairs: 4,
            metrics,
            update: manifest,
            sections: Default::default(),
        };
        (update, chunks)
    }

    /// Publishes an announcement and chunks.
    pub fn publish(&self, update: Update, chunks: Vec<TransferChunk>) {
        self.link.publish(&self.topics.up(&self.id), Message::Update(update).encode()).unwrap();
        self.publish_chunks(chunks);
    }

    /// Publishes chunks of an update announced before.
    pub fn publish_chunks(&self, chunks: Vec<TransferChunk>) {
        for c in chunks {
            self.link.publish(&self.topics.up(&self.id), Message::Chunk(c).encode()).unwrap();
        }
    }

    /// Sends a whole update; with `corrupt`, one byte of its last chunk is flipped in
    /// transit.
    pub fn send(&self, plan: &RoundPlan, round: u64, value: f32, corrupt: bool) {
        let (update, mut chunks) = self.prepare(plan, round, value);
        if corrupt {
            let last = chunks.last_mut().expect("at least one chunk");
            let mut bytes = last.bytes.to_vec();
            let middle = bytes.len() / 2;
            bytes[middle] ^= 0x5a;
            last.bytes = bytes.into();
        }
        *self.holds.lock().unwrap() = plan.model_digest().to_vec();
        self.publish(update, chunks);
    }

    /// Declines the round, as a device whose training failed does.
    pub fn decline(&self, plan: &RoundPlan, reason: &str) {
        self.send_decline(plan, reason, false);
    }

    /// Declines the round because its downlink deltas do not apply to the model it holds,
    /// as a device whose model is gone does.
    pub fn decline_needing_model(&self, plan: &RoundPlan) {
        self.send_decline(plan, "downlink: no usable model is held; asking for the whole model", true);
    }

    fn send_decline(&self, plan: &RoundPlan, reason: &str, needs_model: bool) {
        if needs_model {
            self.holds.lock().unwrap().clear();
        }
        let declined = RoundDeclined { device: self.id.clone(), round: plan.round, reason: reason.into(), needs_model };
        self.link.publish(&self.topics.up(&self.id), Message::Declined(declined).encode()).unwrap();
    }

    /// Waits until everything published has been acknowledged by the broker.
    pub fn flush(&self) -> bool {
        self.link.flush(Duration::from_secs(30))
    }

    /// Takes part in a secure-aggregation round up to the shares (keys, then shares on
    /// the key list), then leaves with a goodbye before sending any input.
    pub fn share_then_leave(&self, plan: &RoundPlan) {
        let settings = plan.secagg.expect("a secure-aggregation plan");
        let party = plan.selected.iter().position(|d| d == &self.id).unwrap() as fedpo_secagg::Party;
        let mut client = fedpo_secagg::Client::new(plan.round, party, usize::from(settings.threshold));
        let keys = SecAggMessage::Keys { round: plan.round, device: self.id.clone(), keys: client.public_keys() };
        self.link.publish(&self.topics.up(&self.id), Message::SecAgg(keys).encode()).unwrap();
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            assert!(Instant::now() < deadline, "no key list for round {}", plan.round);
            let Ok(Some(LinkEvent::Message(d))) = self.link.recv_timeout(Duration::from_millis(100)) else { continue };
            if let Ok(Message::SecAgg(SecAggMessage::KeyList { round, keys })) =
                Message::decode(&d.payload, &Limits::default())
            {
                if round == plan.round {
                    let bundles = client.share(&keys).unwrap();
                    let shares = SecAggMessage::Shares { round, device: self.id.clone(), bundles };
                    self.link.publish(&self.topics.up(&self.id), Message::SecAgg(shares).encode()).unwrap();
                    break;
                }
            }
        }
        let bye = Message::Bye(DeviceBye::new(self.id.clone(), "gone after sharing"));
        self.link.publish(&self.topics.up(&self.id), bye.encode()).unwrap();
        assert!(self.flush());
    }
}
