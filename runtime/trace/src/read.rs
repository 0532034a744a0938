//! Reading traces: the format is recognized by content (not only by extension), the file is
//! parsed by its reader, and step boundaries come from the trace, a sidecar, or inference.

use std::path::{Path, PathBuf};

use crate::error::Location;
use crate::error::{Result, TraceError};
use crate::trace::{StepSource, Trace, TraceFormat};
use crate::{jsonl, profiler, pytorch, rmm, steps};

/// Reads the trace at `path` in whichever format it is, then finds its step boundaries: its own,
/// else those of a sidecar `<stem>.json` with `steps_start_ns`, else inferred (see
/// [`steps::infer`]). Every step begins at its first allocation
/// ([`steps::begin_at_first_allocation`]).
pub fn read_trace(path: impl AsRef<Path>) -> Result<Trace> {
    let path = path.as_ref();
    let bytes = std::fs::read(path).map_err(|source| TraceError::Io { path: path.to_owned(), source })?;
    let mut trace = read_bytes(path, &bytes)?;
    if trace.has_steps() {
        steps::begin_at_first_allocation(&mut trace);
        trace.steps = StepSource::Trace;
    } else if let Some((sidecar, starts)) = read_sidecar(path)? {
        steps::insert_step_starts(&mut trace, &starts);
        trace.steps = StepSource::Sidecar(sidecar);
    } else {
        trace.steps = steps::infer(&mut trace);
    }
    Ok(trace)
}

/// Parses a trace held in memory, gzipped or not; `path` names it in messages. No sidecar, no
/// inference.
pub fn read_bytes(path: &Path, bytes: &[u8]) -> Result<Trace> {
    if bytes.starts_with(&GZIP_MAGIC) {
        let inflated = gunzip(path, bytes)?;
        if inflated.starts_with(&GZIP_MAGIC) {
            // Decompressed once: a gzip inside would escape the limit on inflation.
            return Err(TraceError::malformed(
                path,
                Location::File,
                "a gzip file inside a gzip file; decompress it once first",
            ));
        }
        return read_bytes(path, &inflated);
    }
    // Memory freed in the trace but allocated before it began is live from its start; the
    // snapshot and profiler readers hold it themselves, with what else they know was held.
    let mut trace = match detect(bytes) {
        Some(TraceFormat::Rmm) => rmm::read(path, bytes)?,
        Some(TraceFormat::PyTorch) => return pytorch::read(path, bytes),
        Some(TraceFormat::Profiler) => return profiler::read(path, bytes),
        Some(TraceFormat::Steppool) => jsonl::read(path, bytes)?,
        None => return Err(TraceError::UnknownFormat { path: path.to_owned() }),
    };
    trace.hold_from_start(Vec::new());
    Ok(trace)
}

/// The first bytes of a gzip stream.
const GZIP_MAGIC: [u8; 2] = [0x1f, 0x8b];

/// The most a gzipped trace may inflate to, per compressed byte. Profiler traces compress about
/// 16 to 1 (measured on `cli/tests/data/profiler`); deflate reaches about 1,000 to 1 only on
/// input made to, which is refused before it takes the memory.
const MOST_INFLATION: u64 = 256;

/// The content of a gzip file (every member, as `gzip -d` writes it), at most
/// [`MOST_INFLATION`] times its size (and at least 64 MiB).
fn gunzip(path: &Path, bytes: &[u8]) -> Result<Vec<u8>> {
    use std::io::Read;
    let limit = (bytes.len() as u64).saturating_mul(MOST_INFLATION).max(64 << 20);
    let mut out = Vec::new();
    flate2::read::MultiGzDecoder::new(bytes).take(limit + 1).read_to_end(&mut out).map_err(|e| {
        TraceError::malformed(path, Location::File, format!("a gzip file that cannot be decompressed ({e})"))
    })?;
    if out.len() as u64 > limit {
        return Err(TraceError::malformed(
            path,
            Location::File,
            format!(
                "a gzip file of {} bytes that inflates past {limit} bytes ({MOST_INFLATION} times its size): \
                 not a trace; decompress it first if it is one",
                bytes.len()
            ),
        ));
    }
    Ok(out)
}

/// The format of a trace, from its first bytes: a pickle starts with the PROTO opcode (or, for
/// protocols 0 and 1, a dict opcode); a steppool trace's first line is a JSON object naming
/// `steppool-trace`; a PyTorch profiler trace is JSON naming `traceEvents` near its start
/// ([`profiler::looks_like`]); an RMM log's first line names the `Action` and `Pointer` columns.
/// A gzipped trace is recognized by [`read_bytes`] once decompressed.
pub fn detect(bytes: &[u8]) -> Option<TraceFormat> {
    match bytes.first() {
        Some(0x80) => return Some(TraceFormat::PyTorch),
        Some(b'}' | b'(') => return Some(TraceFormat::PyTorch),
        _ => {}
    }
    let text = bytes.strip_prefix(b"\xef\xbb\xbf").unwrap_or(bytes);
    let first_line = text.split(|&b| b == b'\n').find(|line| !line.iter().all(u8::is_ascii_whitespace))?;
    let first_line = String::from_utf8_lossy(first_line);
    let line = first_line.trim();
    if line.starts_with('{') && line.contains("steppool-trace") {
        return Some(TraceFormat::Steppool);
    }
    if profiler::looks_like(text) {
        return Some(TraceFormat::Profiler);
    }
    let columns: Vec<String> = line.split(',').map(|c| c.trim().to_ascii_lowercase()).collect();
    if columns.iter().any(|c| c == "action") && columns.iter().any(|c| c == "pointer") {
        return Some(TraceFormat::Rmm);
    }
    None
}

/// The sidecar of `trace`: `<stem>.json` beside it, with `steps_start_ns`. `None` when there is
/// no such file, or it has no `steps_start_ns` (a file that is not a sidecar).
pub fn read_sidecar(trace: &Path) -> Result<Option<(PathBuf, Vec<i64>)>> {
    let sidecar = trace.with_extension("json");
    if sidecar == trace || !sidecar.is_file() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(&sidecar).map_err(|source| TraceError::Io { path: sidecar.clone(), source })?;
    let bad = |message: String| TraceError::Sidecar { path: sidecar.clone(), message };
    let value: serde_json::Value = serde_json::from_str(&text).map_err(|e| bad(format!("not JSON: {e}")))?;
    let Some(starts) = value.get("steps_start_ns") else { return Ok(None) };
    let starts = starts.as_array().ok_or_else(|| bad("`steps_start_ns` is not a list".to_owned()))?;
    let starts = starts
        .iter()
        .enumerate()
        .map(|(index, start)| {
            start.as_i64().ok_or_else(|| bad(format!("steps_start_ns[{index}] = {start} is not an integer")))
        })
        .collect::<Result<Vec<i64>>>()?;
    Ok(Some((sidecar, starts)))
}
