//! How a spool record sits on disk: a little-endian length, a CRC-32C of
//! what follows it, a kind byte and the protobuf payload.
//!
//! ```text
//! segment := MAGIC record*
//! record  := len:u32le crc:u32le kind:u8 payload[len - 1]
//! ```
//!
//! The checksum covers the kind and the payload, so a torn write at the end
//! of a segment (the agent or host died mid-write) and a flipped bit in the
//! middle both read as a bad record rather than as a wrong batch.

use std::io::{self, Read};

/// The first bytes of every segment file.
pub const MAGIC: &[u8; 8] = b"HRSPOOL1";
pub const HEADER_LEN: u64 = MAGIC.len() as u64;
/// Far above any batch the collector accepts; a length beyond it is garbage.
pub const MAX_RECORD_BYTES: u32 = 64 << 20;
const FRAME_HEADER: usize = 8;

const CASTAGNOLI: crc::Crc<u32> = crc::Crc::<u32>::new(&crc::CRC_32_ISCSI);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A `RegisterRequest`: the inventory the batches after it were sampled under.
    Register = 1,
    /// A `Batch` with its stream id and sequence number set.
    Batch = 2,
    /// Sequence numbers up to this one (u64 little-endian) may have been
    /// handed out; a restarted agent continues after it.
    Reserve = 3,
}

impl Kind {
    fn from_byte(byte: u8) -> Option<Self> {
        match byte {
            1 => Some(Self::Register),
            2 => Some(Self::Batch),
            3 => Some(Self::Reserve),
            _ => None,
        }
    }
}

/// Appends one framed record to `out`.
pub fn encode(kind: Kind, payload: &[u8], out: &mut Vec<u8>) {
    let len = u32::try_from(payload.len() + 1).unwrap_or(u32::MAX);
    let mut digest = CASTAGNOLI.digest();
    digest.update(&[kind as u8]);
    digest.update(payload);
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(&digest.finalize().to_le_bytes());
    out.push(kind as u8);
    out.extend_from_slice(payload);
}

/// What reading at a record boundary found.
#[derive(Debug, PartialEq, Eq)]
pub enum Frame {
    Record {
        kind: Kind,
        payload: Vec<u8>,
        /// Bytes the record took on disk, header included.
        len: u64,
    },
    /// A clean end: no byte after the previous record.
    End,
    /// The data stops inside a record: a write that did not finish.
    Torn,
    /// A record whose length, checksum or kind is wrong.
    Corrupt(String),
}

/// Reads the record starting at the reader's position.
pub fn read(reader: &mut impl Read) -> io::Result<Frame> {
    let mut header = [0u8; FRAME_HEADER];
    match read_full(reader, &mut header)? {
        0 => return Ok(Frame::End),
        n if n < FRAME_HEADER => return Ok(Frame::Torn),
        _ => {}
    }
    let [l0, l1, l2, l3, c0, c1, c2, c3] = header;
    let len = u32::from_le_bytes([l0, l1, l2, l3]);
    let crc = u32::from_le_bytes([c0, c1, c2, c3]);
    if len == 0 || len > MAX_RECORD_BYTES {
        return Ok(Frame::Corrupt(format!("record length {len} is impossible")));
    }
    let mut body = vec![0u8; len as usize];
    if read_full(reader, &mut body)? < body.len() {
        return Ok(Frame::Torn);
    }
    let actual = CASTAGNOLI.checksum(&body);
    if actual != crc {
        return Ok(Frame::Corrupt(format!(
            "checksum {actual:08x} does not match the stored {crc:08x}"
        )));
    }
    let Some(kind) = Kind::from_byte(body[0]) else {
        return Ok(Frame::Corrupt(format!("unknown record kind {}", body[0])));
    };
    body.remove(0);
    Ok(Frame::Record {
        kind,
        payload: body,
        len: FRAME_HEADER as u64 + u64::from(len),
    })
}

/// Like `read_exact`, but says how much it got when the data ends early.
fn read_full(reader: &mut impl Read, buf: &mut [u8]) -> io::Result<usize> {
    let mut filled = 0;
    while filled < buf.len() {
        match reader.read(&mut buf[filled..]) {
            Ok(0) => break,
            Ok(n) => filled += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(filled)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn framed(kind: Kind, payload: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        encode(kind, payload, &mut out);
        out
    }

    #[test]
    fn a_record_reads_back_with_its_kind_and_length() {
        let bytes = framed(Kind::Batch, b"hello");
        let mut reader = &bytes[..];
        assert_eq!(
            read(&mut reader).unwrap(),
            Frame::Record {
                kind: Kind::Batch,
                payload: b"hello".to_vec(),
                len: bytes.len() as u64
            }
        );
        assert_eq!(read(&mut reader).unwrap(), Frame::End);
    }

    #[test]
    fn every_truncation_reads_as_torn() {
        let bytes = framed(Kind::Register, b"inventory");
        for cut in 1..bytes.len() {
            assert_eq!(
                read(&mut &bytes[..cut]).unwrap(),
                Frame::Torn,
                "cut at {cut}"
            );
        }
    }

    #[test]
    fn every_flipped_byte_is_caught() {
        let bytes = framed(Kind::Batch, b"0123456789");
        for at in 0..bytes.len() {
            let mut bad = bytes.clone();
            bad[at] ^= 0x10;
            let frame = read(&mut &bad[..]).unwrap();
            assert!(
                matches!(frame, Frame::Corrupt(_) | Frame::Torn),
                "flip at {at} read as {frame:?}"
            );
        }
    }

    #[test]
    fn an_impossible_length_is_named() {
        let mut bytes = framed(Kind::Batch, b"x");
        bytes[..4].copy_from_slice(&u32::MAX.to_le_bytes());
        let Frame::Corrupt(why) = read(&mut &bytes[..]).unwrap() else {
            panic!("not corrupt")
        };
        assert!(why.contains("length"), "{why}");
    }
}
