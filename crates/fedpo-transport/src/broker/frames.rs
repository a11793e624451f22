//! The bytes the broker writes: MQTT 3.1.1 packets as [`Frame`]s.
//!
//! A publish is split so that its payload is stored once however many clients it goes
//! to: each client gets its own fixed and variable header (its packet id) in front of
//! the shared body.

use bytes::{BufMut, Bytes, BytesMut};
use rumqttc::mqttbytes::v4::Packet;
use rumqttc::mqttbytes::QoS;

use super::queue::Frame;

/// The MQTT "remaining length": 7 bits per byte, least significant first.
fn put_remaining_length(out: &mut BytesMut, mut len: usize) {
    loop {
        let mut byte = (len % 128) as u8;
        len /= 128;
        if len > 0 {
            byte |= 0x80;
        }
        out.put_u8(byte);
        if len == 0 {
            break;
        }
    }
}

/// A publish of `payload` on `topic`, as one subscriber receives it: QoS 0 or 1 (the
/// broker grants no more), never retained, `pkid` used only at QoS 1.
pub(super) fn publish(topic: &str, qos: QoS, pkid: u16, payload: Bytes) -> Frame {
    let qos_bits = match qos {
        QoS::AtMostOnce => 0,
        _ => 1,
    };
    let remaining = 2 + topic.len() + if qos_bits > 0 { 2 } else { 0 } + payload.len();
    let mut head = BytesMut::with_capacity(5 + 2 + topic.len() + 2);
    head.put_u8(0x30 | (qos_bits << 1));
    put_remaining_length(&mut head, remaining);
    head.put_u16(topic.len() as u16);
    head.put_slice(topic.as_bytes());
    if qos_bits > 0 {
        head.put_u16(pkid);
    }
    Frame { head: head.freeze(), body: payload }
}

/// A packet without a payload worth sharing (acknowledgements, ping responses).
pub(super) fn control(packet: &Packet) -> Frame {
    let mut out = BytesMut::with_capacity(packet.size());
    // Writing these small packets into a buffer that grows cannot fail.
    let _ = packet.write(&mut out, usize::MAX);
    Frame::control(out.freeze())
}

#[cfg(test)]
mod tests {
    use rumqttc::mqttbytes::v4::Publish;

    use super::*;

    fn joined(f: &Frame) -> Vec<u8> {
        [f.head.as_ref(), f.body.as_ref()].concat()
    }

    #[test]
    fn split_publishes_are_byte_for_byte_what_rumqttc_writes() {
        for (qos, payload_len) in [(QoS::AtMostOnce, 0), (QoS::AtLeastOnce, 5), (QoS::AtLeastOnce, 200_000)] {
            let payload = Bytes::from((0..payload_len).map(|i| i as u8).collect::<Vec<_>>());
            let mut reference = Publish::from_bytes("fedpo/job/down", qos, payload.clone());
            reference.pkid = if qos == QoS::AtMostOnce { 0 } else { 517 };
            let mut expected = BytesMut::new();
            Packet::Publish(reference).write(&mut expected, usize::MAX).unwrap();
            let ours = publish("fedpo/job/down", qos, 517, payload);
            assert_eq!(joined(&ours), expected.to_vec(), "{qos:?}, {payload_len} bytes");
            let mut parse = BytesMut::from(&joined(&ours)[..]);
            assert!(matches!(Packet::read(&mut parse, usize::MAX).unwrap(), Packet::Publish(_)));
        }
    }
}
