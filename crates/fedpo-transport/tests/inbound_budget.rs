//! A link with an inbound byte budget: it stops reading from the broker once that many
//! received bytes wait, loses nothing, and still publishes. Its own test binary, so its
//! flood does not share a process with the timing-sensitive link tests.

use std::time::{Duration, Instant};

use fedpo_transport::{EmbeddedBroker, LinkEvent, LinkOptions, MqttLink};

fn next_message(link: &MqttLink, within: Duration) -> Option<(String, Vec<u8>)> {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if let Some(LinkEvent::Message(d)) = link.recv_timeout(Duration::from_millis(100)).unwrap() {
            return Some((d.topic, d.payload.to_vec()));
        }
    }
    None
}

#[test]
fn a_link_with_an_inbound_budget_queues_no_more_than_it_yet_loses_nothing_and_still_publishes() {
    let broker = EmbeddedBroker::start_on_free_port().unwrap();
    let budget = 1 << 20;
    let mut opts = LinkOptions::new("bounded");
    opts.inbound_budget = Some(budget);
    let bounded = MqttLink::connect(&broker.url(), &opts).unwrap();
    let unbounded = MqttLink::connect(&broker.url(), &LinkOptions::new("unbounded")).unwrap();
    for link in [&bounded, &unbounded] {
        link.subscribe("fedpo/t/up/#").unwrap();
    }
    std::thread::sleep(Duration::from_millis(200));
    let tx = MqttLink::connect(&broker.url(), &LinkOptions::new("tx")).unwrap();
    let messages: Vec<Vec<u8>> = (0..30u8).map(|i| vec![i; 100_000]).collect();
    for m in &messages {
        tx.publish("fedpo/t/up/dev", m.clone()).unwrap();
    }
    assert!(tx.flush(Duration::from_secs(20)));
    std::thread::sleep(Duration::from_secs(1));
    assert_eq!(unbounded.inbound_bytes(), 3_000_000, "without a budget everything queues");
    assert!(bounded.inbound_bytes() <= budget, "{} bytes queued past the budget", bounded.inbound_bytes());

    // While its queue is full, the bounded link can still publish: the event loop turns
    // while a publish of its own waits to be written.
    for i in 0..40u8 {
        bounded.publish("fedpo/t/down", vec![i; 50_000]).unwrap();
    }

    for expected in &messages {
        let (_, payload) = next_message(&bounded, Duration::from_secs(20)).expect("every message arrives");
        assert_eq!(&payload, expected);
    }
    assert!(bounded.flush(Duration::from_secs(20)), "its publishes were acknowledged once it read again");
}
