//! Just enough of Python's pickle protocol 3 to write plain data: dicts with string keys, lists,
//! tuples, strings, integers and booleans. Only opcodes that `pickle.load` and
//! PyTorch's memory viewer (pytorch.org/memory_viz) both read.

use std::io::{self, Write};

/// A plain Python value.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Value {
    Bool(bool),
    Int(i128),
    Str(String),
    List(Vec<Value>),
    Tuple(Vec<Value>),
    Dict(Vec<(String, Value)>),
}

impl From<&str> for Value {
    fn from(text: &str) -> Self {
        Value::Str(text.to_owned())
    }
}

impl From<String> for Value {
    fn from(text: String) -> Self {
        Value::Str(text)
    }
}

impl From<u64> for Value {
    fn from(n: u64) -> Self {
        Value::Int(n.into())
    }
}

impl From<bool> for Value {
    fn from(b: bool) -> Self {
        Value::Bool(b)
    }
}

/// Builds a dict from `(key, value)` pairs.
pub(crate) fn dict<const N: usize>(items: [(&str, Value); N]) -> Value {
    Value::Dict(items.into_iter().map(|(key, value)| (key.to_owned(), value)).collect())
}

/// Items per `MARK ... SETITEMS`/`APPENDS` batch, as CPython writes them.
const BATCH: usize = 1000;

/// Writes `value` as a protocol-3 pickle.
pub(crate) fn write(out: &mut impl Write, value: &Value) -> io::Result<()> {
    out.write_all(&[0x80, 3])?;
    write_value(out, value)?;
    out.write_all(b".")
}

fn write_str(out: &mut impl Write, text: &str) -> io::Result<()> {
    out.write_all(b"X")?;
    out.write_all(&(text.len() as u32).to_le_bytes())?;
    out.write_all(text.as_bytes())
}

fn write_int(out: &mut impl Write, n: i128) -> io::Result<()> {
    if (0..=0xff).contains(&n) {
        out.write_all(&[b'K', n as u8])
    } else if (0..=0xffff).contains(&n) {
        out.write_all(b"M")?;
        out.write_all(&(n as u16).to_le_bytes())
    } else if i32::try_from(n).is_ok() {
        out.write_all(b"J")?;
        out.write_all(&(n as i32).to_le_bytes())
    } else {
        // LONG1: the shortest little-endian two's complement that keeps the sign.
        let bytes = n.to_le_bytes();
        let mut len = bytes.len();
        while len > 1 {
            let (last, next) = (bytes[len - 1], bytes[len - 2]);
            let redundant = (last == 0 && next & 0x80 == 0) || (last == 0xff && next & 0x80 != 0);
            if !redundant {
                break;
            }
            len -= 1;
        }
        out.write_all(&[0x8a, len as u8])?;
        out.write_all(&bytes[..len])
    }
}

fn write_value(out: &mut impl Write, value: &Value) -> io::Result<()> {
    match value {
        Value::Bool(true) => out.write_all(&[0x88]),
        Value::Bool(false) => out.write_all(&[0x89]),
        Value::Int(n) => write_int(out, *n),
        Value::Str(text) => write_str(out, text),
        Value::List(items) => {
            out.write_all(b"]")?;
            for batch in items.chunks(BATCH) {
                out.write_all(b"(")?;
                for item in batch {
                    write_value(out, item)?;
                }
                out.write_all(b"e")?;
            }
            Ok(())
        }
        Value::Tuple(items) => {
            out.write_all(b"(")?;
            for item in items {
                write_value(out, item)?;
            }
            out.write_all(b"t")
        }
        Value::Dict(items) => {
            out.write_all(b"}")?;
            for batch in items.chunks(BATCH) {
                out.write_all(b"(")?;
                for (key, item) in batch {
                    write_str(out, key)?;
                    write_value(out, item)?;
                }
                out.write_all(b"u")?;
            }
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes(value: &Value) -> Vec<u8> {
        let mut out = Vec::new();
        write(&mut out, value).unwrap();
        out
    }

    #[test]
    fn integers_take_the_shortest_opcode() {
        assert_eq!(bytes(&Value::Int(7)), [0x80, 3, b'K', 7, b'.']);
        assert_eq!(bytes(&Value::Int(0x1234)), [0x80, 3, b'M', 0x34, 0x12, b'.']);
        assert_eq!(bytes(&Value::Int(-1)), [0x80, 3, b'J', 0xff, 0xff, 0xff, 0xff, b'.']);
        // 2^31 needs five bytes: 0x80 would read as negative in four.
        assert_eq!(bytes(&Value::Int(1 << 31)), [0x80, 3, 0x8a, 5, 0, 0, 0, 0x80, 0, b'.']);
        assert_eq!(bytes(&Value::Int(-(1 << 40))), [0x80, 3, 0x8a, 6, 0, 0, 0, 0, 0, 0xff, b'.']);
    }

    #[test]
    fn containers_are_marked_and_batched() {
        let list = Value::List((0..1001).map(|n| Value::Int(n % 2)).collect());
        let out = bytes(&list);
        assert_eq!(out.iter().filter(|&&b| b == b'e').count(), 2);
        let dict = dict([("a", false.into()), ("b", true.into())]);
        let expected = [0x80, 3, b'}', b'(', b'X', 1, 0, 0, 0, b'a', 0x89, b'X', 1, 0, 0, 0, b'b', 0x88, b'u', b'.'];
        assert_eq!(bytes(&dict), expected);
    }
}
