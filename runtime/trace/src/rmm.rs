//! RMM `logging_resource_adaptor` CSV logs: `Thread,Time,Action,Pointer,Size,Stream`.
//!
//! Columns are found by their header names, so extra or reordered columns are fine. `Action` is
//! `allocate`, `free` or `allocate failure`. `Time` is nanoseconds (an integer) or RMM's clock
//! time `HH:MM:SS.ffffff` (any number of fractional digits; a time earlier than the one before by
//! more than twelve hours is taken as having crossed midnight). `Pointer` and `Stream` are hex,
//! with or without `0x`, as RMM writes them. RMM logs one device per file (`.devN`): events are
//! on device 0.

use std::path::Path;

use crate::error::{Location, Result, TraceError};
use crate::trace::{Event, EventKind, Threads, Trace, TraceFormat, WarningKind};

const NS_PER_DAY: u64 = 86_400 * 1_000_000_000;

struct Columns {
    count: usize,
    thread: Option<usize>,
    time: Option<usize>,
    action: usize,
    pointer: usize,
    size: usize,
    stream: Option<usize>,
}

/// Reads an RMM CSV log; `path` names it in messages.
pub fn read(path: &Path, bytes: &[u8]) -> Result<Trace> {
    let mut trace = Trace::new(path, TraceFormat::Rmm);
    let mut threads = Threads::default();
    let bytes = bytes.strip_prefix(b"\xef\xbb\xbf").unwrap_or(bytes);
    let mut columns = None;
    let mut last_time: Option<u64> = None;
    let mut day_offset = 0u64;
    for (index, raw) in bytes.split(|&b| b == b'\n').enumerate() {
        let location = Location::Line(index as u64 + 1);
        let bad = |message: String| TraceError::malformed(path, location, message);
        let line = std::str::from_utf8(raw).map_err(|e| bad(format!("not UTF-8 text ({e})")))?;
        let line = line.trim_end_matches('\r');
        if line.trim().is_empty() {
            continue;
        }
        let Some(columns) = &columns else {
            columns = Some(header(line).map_err(bad)?);
            continue;
        };
        let fields: Vec<&str> = line.split(',').map(str::trim).collect();
        if fields.len() != columns.count {
            return Err(bad(format!(
                "expected {} comma-separated fields as in the header, found {}",
                columns.count,
                fields.len()
            )));
        }
        let action = fields[columns.action];
        let kind = match action.to_ascii_lowercase().as_str() {
            "allocate" => EventKind::Alloc,
            "free" => EventKind::Free { released: false },
            "allocate failure" => EventKind::AllocFailure,
            _ => {
                trace.warnings.add(WarningKind::UnknownAction, location, || format!("action `{action}`"));
                continue;
            }
        };
        let ptr = parse_hex(fields[columns.pointer])
            .ok_or_else(|| bad(format!("Pointer `{}` is not a hexadecimal address", fields[columns.pointer])))?;
        let size = fields[columns.size];
        let bytes = size.parse::<u64>().map_err(|_| bad(format!("Size `{size}` is not a byte count")))?;
        let stream = match columns.stream {
            Some(column) => parse_hex(fields[column])
                .ok_or_else(|| bad(format!("Stream `{}` is not a hexadecimal handle", fields[column])))?,
            None => 0,
        };
        let t_ns = match columns.time {
            Some(column) => {
                let mut t = parse_time(fields[column]).map_err(bad)?;
                if fields[column].contains(':') {
                    // Clock time: count days when it goes back by more than half a day.
                    let overflow = || bad("clock time past 584 years of days".to_owned());
                    t = t.checked_add(day_offset).ok_or_else(overflow)?;
                    if let Some(last) = last_time
                        && t.saturating_add(NS_PER_DAY / 2) < last
                    {
                        day_offset = day_offset.checked_add(NS_PER_DAY).ok_or_else(overflow)?;
                        t = t.checked_add(NS_PER_DAY).ok_or_else(overflow)?;
                    }
                }
                t
            }
            None => index as u64,
        };
        if let Some(last) = last_time
            && t_ns < last
        {
            trace.warnings.add(WarningKind::TimeBackwards, location, || format!("time {t_ns} ns after {last} ns"));
        }
        last_time = Some(last_time.map_or(t_ns, |last| last.max(t_ns)));
        let thread = match columns.thread {
            Some(column) => threads.index(&mut trace, fields[column]),
            None => threads.index(&mut trace, "0"),
        };
        let mut event = Event::new(t_ns, kind, location);
        event.ptr = ptr;
        event.bytes = bytes;
        event.stream = stream;
        event.thread = thread;
        trace.events.push(event);
    }
    if columns.is_none() {
        return Err(TraceError::malformed(path, Location::Line(1), "empty file: no `Thread,Time,Action,...` header"));
    }
    if !trace.events.is_empty() {
        trace.note_device(0);
    }
    Ok(trace)
}

fn header(line: &str) -> std::result::Result<Columns, String> {
    let names: Vec<String> = line.split(',').map(|c| c.trim().to_ascii_lowercase()).collect();
    let find = |name: &str| names.iter().position(|c| c == name);
    let required = |name: &str| {
        find(name).ok_or_else(|| {
            format!("the header `{line}` has no `{name}` column; RMM logs start with `Thread,Time,Action,Pointer,Size,Stream`")
        })
    };
    Ok(Columns {
        count: names.len(),
        thread: find("thread"),
        time: find("time"),
        action: required("action")?,
        pointer: required("pointer")?,
        size: required("size")?,
        stream: find("stream"),
    })
}

/// A hexadecimal number, with or without `0x`.
fn parse_hex(text: &str) -> Option<u64> {
    let digits = text.strip_prefix("0x").or_else(|| text.strip_prefix("0X")).unwrap_or(text);
    if digits.is_empty() || digits.len() > 16 {
        return None;
    }
    u64::from_str_radix(digits, 16).ok()
}

/// Nanoseconds, or a clock time `HH:MM:SS[.fraction]` as nanoseconds since midnight.
fn parse_time(text: &str) -> std::result::Result<u64, String> {
    let bad = || format!("Time `{text}` is neither nanoseconds nor a clock time HH:MM:SS.ffffff");
    if !text.contains(':') {
        return text.parse::<u64>().map_err(|_| bad());
    }
    let mut parts = text.split(':');
    let (Some(h), Some(m), Some(s), None) = (parts.next(), parts.next(), parts.next(), parts.next()) else {
        return Err(bad());
    };
    let number = |part: &str, max: u64| -> std::result::Result<u64, String> {
        if part.is_empty() || part.len() > 2 || !part.bytes().all(|b| b.is_ascii_digit()) {
            return Err(bad());
        }
        part.parse::<u64>().ok().filter(|&value| value <= max).ok_or_else(bad)
    };
    let (whole, fraction) = s.split_once('.').unwrap_or((s, ""));
    let (hours, minutes, seconds) = (number(h, 23)?, number(m, 59)?, number(whole, 60)?);
    if fraction.len() > 9 || !fraction.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad());
    }
    let nanos = if fraction.is_empty() {
        0
    } else {
        fraction.parse::<u64>().map_err(|_| bad())? * 10u64.pow(9 - fraction.len() as u32)
    };
    Ok(((hours * 60 + minutes) * 60 + seconds) * 1_000_000_000 + nanos)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clock_times_and_nanoseconds() {
        assert_eq!(parse_time("1234"), Ok(1234));
        assert_eq!(parse_time("00:00:01.5"), Ok(1_500_000_000));
        assert_eq!(parse_time("10:20:30.123456"), Ok(((10 * 60 + 20) * 60 + 30) * 1_000_000_000 + 123_456_000));
        assert!(parse_time("10:20").is_err());
        assert!(parse_time("25:00:00").is_err());
        assert!(parse_time("10:20:30.1234567890").is_err());
        assert!(parse_time("-5").is_err());
    }

    #[test]
    fn hex_with_and_without_prefix() {
        assert_eq!(parse_hex("0x7f00"), Some(0x7f00));
        assert_eq!(parse_hex("7f00"), Some(0x7f00));
        assert_eq!(parse_hex("0x"), None);
        assert_eq!(parse_hex("0x12345678901234567"), None);
        assert_eq!(parse_hex("zz"), None);
    }

    #[test]
    fn midnight_is_crossed() {
        let log =
            "Thread,Time,Action,Pointer,Size,Stream\n1,23:59:59.9,allocate,0x10,8,0x0\n1,00:00:00.1,free,0x10,8,0x0\n";
        let trace = read(Path::new("x.csv"), log.as_bytes()).unwrap();
        assert_eq!(trace.events[1].t_ns - trace.events[0].t_ns, 200_000_000);
        assert!(trace.warnings.is_empty());
    }
}
