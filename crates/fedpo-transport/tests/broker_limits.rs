//! The embedded broker's limits and access rules, with real clients on loopback.

use std::io::Write;
use std::net::TcpStream;
use std::time::{Duration, Instant};

use bytes::BytesMut;
use fedpo_transport::{BrokerConfig, BrokerLimits, BrokerUrl, EmbeddedBroker, LinkEvent, LinkOptions, MqttLink};
use rumqttc::mqttbytes::v4::{Connect, Packet, Publish, Subscribe};
use rumqttc::mqttbytes::QoS;

const MIB: usize = 1 << 20;

/// A client that sends what it is given and never reads its socket.
fn silent_client(broker: &EmbeddedBroker, packets: &[Packet]) -> TcpStream {
    let mut stream = TcpStream::connect(broker.addr()).unwrap();
    let mut bytes = BytesMut::new();
    for p in packets {
        p.write(&mut bytes, usize::MAX).unwrap();
    }
    stream.write_all(&bytes).unwrap();
    stream
}

fn connect(client: &str) -> Packet {
    let mut c = Connect::new(client);
    c.keep_alive = 0;
    Packet::Connect(c)
}

fn received(link: &MqttLink, within: Duration) -> Vec<String> {
    let mut topics = Vec::new();
    let deadline = Instant::now() + within;
    while let Some(left) = deadline.checked_duration_since(Instant::now()) {
        if let Some(LinkEvent::Message(d)) = link.recv_timeout(left.min(Duration::from_millis(100))).unwrap() {
            topics.push(d.topic);
        }
    }
    topics
}

fn wait_for(what: &str, within: Duration, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !done() {
        assert!(Instant::now() < deadline, "{what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_subscriber_that_never_reads_holds_at_most_its_queue_and_is_cut_off_after_the_stall() {
    let limits = BrokerLimits { queue_bytes: 4 * MIB, stall: Duration::from_secs(2), ..BrokerLimits::default() };
    let localhost = "127.0.0.1:0".parse().unwrap();
    let broker = EmbeddedBroker::start_with(localhost, BrokerConfig { limits, ..BrokerConfig::default() }).unwrap();
    let reader = MqttLink::connect(&broker.url(), &LinkOptions::new("reader")).unwrap();
    reader.subscribe("t/#").unwrap();
    let _silent =
        silent_client(&broker, &[connect("silent"), Packet::Subscribe(Subscribe::new("#", QoS::AtLeastOnce))]);
    // The reader is two connections (one each way), the silent client one.
    wait_for("the silent client never connected", Duration::from_secs(5), || broker.connections() == 3);

    let publisher = MqttLink::connect(&broker.url(), &LinkOptions::new("publisher")).unwrap();
    let sending = std::thread::spawn(move || {
        // More than loopback's socket buffers take (up to 32 MiB received, 4 MiB sent).
        for k in 0..96 {
            publisher.publish(&format!("t/{k}"), vec![k as u8; MIB]).unwrap();
        }
        publisher.flush(Duration::from_secs(30))
    });
    let mut most = 0;
    while !sending.is_finished() {
        most = most.max(broker.queued_bytes());
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(sending.join().unwrap(), "the publisher was held for good by a client that never reads");
    // Two queues at most (the silent one full, the reader's draining), each within its
    // limit: nowhere near the 96 MiB published.
    assert!(most <= 2 * 4 * MIB + (64 << 10), "{most} bytes queued");
    assert_eq!(received(&reader, Duration::from_secs(5)).len(), 96, "the reader lost messages");
    // The publisher has closed its link: the reader's two connections are left.
    wait_for("the silent client is still connected", Duration::from_secs(5), || broker.connections() == 2);
    wait_for("delivered messages are still held", Duration::from_secs(5), || broker.queued_bytes() == 0);
}

#[test]
fn retained_messages_are_delivered_once_and_never_stored() {
    let broker = EmbeddedBroker::start_on_free_port().unwrap();
    let live = MqttLink::connect(&broker.url(), &LinkOptions::new("live")).unwrap();
    live.subscribe("kept/#").unwrap();
    let mut retained = Publish::new("kept/1", QoS::AtMostOnce, vec![7u8; 1000]);
    retained.retain = true;
    let _retainer = silent_client(&broker, &[connect("retainer"), Packet::Publish(retained)]);
    assert_eq!(received(&live, Duration::from_secs(2)), ["kept/1"]);
    let late = MqttLink::connect(&broker.url(), &LinkOptions::new("late")).unwrap();
    late.subscribe("kept/#").unwrap();
    assert!(received(&late, Duration::from_secs(1)).is_empty(), "a retained message was stored");
}

#[test]
fn with_logins_a_device_publishes_only_on_its_own_uplink_and_reads_only_the_downlink() {
    let logins = [("dev-1", "one"), ("dev-2", "two"), ("agg", "secret")].map(|(u, p)| (u.to_string(), p.to_string()));
    let config = BrokerConfig { logins: Some(logins.into()), admin: Some("agg".into()), ..BrokerConfig::default() };
    let broker = EmbeddedBroker::start_with("127.0.0.1:0".parse().unwrap(), config).unwrap();
    let as_user = |user: &str, password: &str| BrokerUrl {
        username: Some(user.into()),
        password: Some(password.into()),
        ..broker.url()
    };
    let aggregator = MqttLink::connect(&as_user("agg", "secret"), &LinkOptions::new("fedpo-j-aggregator")).unwrap();
    aggregator.subscribe("fedpo/j/up/+").unwrap();
    let dev1 = MqttLink::connect(&as_user("dev-1", "one"), &LinkOptions::new("fedpo-j-dev-1")).unwrap();
    dev1.subscribe("fedpo/j/down").unwrap();
    // dev-1 tries to read every device's uploads too; the broker refuses the filter.
    let _ = dev1.subscribe("fedpo/j/up/+");
    // dev-2 logs in under dev-1's client id: a session of its own, dev-1 stays.
    let dev2 = MqttLink::connect(&as_user("dev-2", "two"), &LinkOptions::new("fedpo-j-dev-1")).unwrap();

    dev1.publish("fedpo/j/up/dev-2", b"posing as dev-2".to_vec()).unwrap();
    dev1.publish("fedpo/j/down", b"a forged plan".to_vec()).unwrap();
    dev1.publish("fedpo/j/up/dev-1", b"hello".to_vec()).unwrap();
    dev2.publish("fedpo/j/up/dev-2", b"hello".to_vec()).unwrap();
    aggregator.publish("fedpo/j/down", b"plan".to_vec()).unwrap();
    assert!(dev1.flush(Duration::from_secs(5)) && dev2.flush(Duration::from_secs(5)));

    let mut heard = received(&aggregator, Duration::from_secs(2));
    heard.sort();
    assert_eq!(heard, ["fedpo/j/up/dev-1", "fedpo/j/up/dev-2"]);
    assert_eq!(
        received(&dev1, Duration::from_secs(1)),
        ["fedpo/j/down"],
        "dev-1 read what it may not, or lost its session"
    );
    let wrong = BrokerUrl { password: Some("one".into()), ..as_user("dev-2", "") };
    let mut opts = LinkOptions::new("guess");
    opts.connect_wait = Duration::from_secs(2);
    assert!(MqttLink::connect(&wrong, &opts).is_err(), "dev-2 logged in with dev-1's password");
}
