//! The simulated device against a small reference model, over random sequences of allocations,
//! frees, event records and waits, synchronizations, queries, trims and attribute changes on
//! several streams and pools.
//!
//! The model keeps its own stream clocks, live allocations, freed ranges and mapped units, and
//! after every call checks that:
//! - no two live allocations overlap, each lies inside one of its pool's address ranges, and the
//!   device's live allocations are the model's;
//! - every unit an allocation overlaps is mapped, every pool counter (used, reserved, and their
//!   high-water marks) and the mapped units equal the model's, and `cuMemGetInfo` agrees with the
//!   sum of reservations, which never exceeds capacity;
//! - memory freed on one stream is handed to another only once stream order allows it: the
//!   other stream is ordered after the free (an event or the legacy stream), the host observed
//!   the free complete, or the device was full and the pool allows internal dependencies;
//! - a pool fails, or takes an internal dependency, only when the device cannot map the units a
//!   request needs even after every idle unit on it is released;
//! - idle units go back exactly as the release threshold and trim rules say, and an allocation
//!   that maps units first moves the memory of the pool's idle units it may reuse, highest
//!   address first, so that a pool reserves the most units that held a live byte at once.
//!
//! Where the placement itself is a free choice (which fitting piece), the model accepts the
//! device's choice and checks it against these rules.

use std::collections::{BTreeMap, BTreeSet};

use proptest::prelude::*;
use steppool_sys::{
    CU_STREAM_LEGACY, CUdeviceptr, CUevent, CUevent_flags, CUmemPool_attribute, CUmemoryPool, CUresult, CUstream,
    CUstream_flags, Driver, PoolProps,
    sim::{PoolLayout, SimConfig},
};

const MIB: u64 = 1 << 20;
const GRANULE: u64 = 2 * MIB;
/// Smaller than the driver's 32 MiB, so that allocations cross units and a few fill the device.
const UNIT: u64 = 4 * MIB;
const CAPACITY: u64 = 32 * MIB;
const ALIGNMENT: u64 = 512;
const POOLS: usize = 2;
const EVENTS: usize = 2;
/// Streams 0 and 1 are non-blocking, 2 is blocking, 3 is the legacy default stream.
const STREAMS: usize = 4;
const BLOCKING: usize = 2;
const LEGACY: usize = 3;

#[derive(Clone, Debug)]
enum Op {
    Alloc { pool: usize, stream: usize, bytes: u64 },
    Free { pick: usize, stream: usize },
    FreeAgain { pick: usize, stream: usize },
    Record { event: usize, stream: usize },
    Wait { stream: usize, event: usize },
    SyncStream { stream: usize },
    SyncEvent { event: usize },
    SyncContext,
    Query { stream: usize },
    Trim { pool: usize, keep: u64 },
    Threshold { pool: usize, bytes: u64 },
    FollowEvents { pool: usize, on: bool },
    Internal { pool: usize, on: bool },
}

fn bytes() -> impl Strategy<Value = u64> {
    prop_oneof![
        3 => prop::sample::select(vec![1, 512, 1000, 64 << 10, MIB, 2 * MIB, 3 * MIB, 6 * MIB, 12 * MIB]),
        2 => 1..=5 * MIB,
    ]
}

fn op() -> impl Strategy<Value = Op> {
    let pool = 0..POOLS;
    let stream = 0..STREAMS;
    let event = 0..EVENTS;
    prop_oneof![
        8 => (pool.clone(), stream.clone(), bytes()).prop_map(|(pool, stream, bytes)| Op::Alloc { pool, stream, bytes }),
        6 => (any::<usize>(), stream.clone()).prop_map(|(pick, stream)| Op::Free { pick, stream }),
        1 => (any::<usize>(), stream.clone()).prop_map(|(pick, stream)| Op::FreeAgain { pick, stream }),
        2 => (event.clone(), stream.clone()).prop_map(|(event, stream)| Op::Record { event, stream }),
        2 => (stream.clone(), event.clone()).prop_map(|(stream, event)| Op::Wait { stream, event }),
        1 => stream.clone().prop_map(|stream| Op::SyncStream { stream }),
        1 => event.prop_map(|event| Op::SyncEvent { event }),
        1 => Just(Op::SyncContext),
        1 => stream.prop_map(|stream| Op::Query { stream }),
        1 => (pool.clone(), 0..8u64).prop_map(|(pool, granules)| Op::Trim { pool, keep: granules * GRANULE }),
        1 => (pool.clone(), prop::sample::select(vec![0, 4 * MIB, u64::MAX]))
            .prop_map(|(pool, bytes)| Op::Threshold { pool, bytes }),
        1 => (pool.clone(), any::<bool>()).prop_map(|(pool, on)| Op::FollowEvents { pool, on }),
        1 => (pool, any::<bool>()).prop_map(|(pool, on)| Op::Internal { pool, on }),
    ]
}

type Clock = BTreeMap<usize, u64>;

fn join(into: &mut Clock, other: &Clock) {
    for (&stream, &position) in other {
        let entry = into.entry(stream).or_insert(0);
        *entry = (*entry).max(position);
    }
}

fn get(clock: &Clock, stream: usize) -> u64 {
    clock.get(&stream).copied().unwrap_or(0)
}

#[derive(Clone, Debug, Default)]
struct ModelStream {
    position: u64,
    clock: Clock,
}

#[derive(Clone, Copy, Debug)]
struct Freed {
    start: u64,
    len: u64,
    stream: usize,
    position: u64,
}

#[derive(Clone, Debug)]
struct ModelPool {
    used: u64,
    used_high: u64,
    reserved: u64,
    reserved_high: u64,
    threshold: u64,
    follow_events: bool,
    internal: bool,
    /// Bases of the mapped units.
    units: BTreeSet<u64>,
    /// Ranges whose latest event was a free, with that free's stream and position.
    freed: Vec<Freed>,
}

impl Default for ModelPool {
    fn default() -> Self {
        Self {
            used: 0,
            used_high: 0,
            reserved: 0,
            reserved_high: 0,
            threshold: 0,
            follow_events: true,
            internal: true,
            units: BTreeSet::new(),
            freed: Vec::new(),
        }
    }
}

#[derive(Debug, Default)]
struct Model {
    streams: Vec<ModelStream>,
    completed: Clock,
    events: Vec<Option<Clock>>,
    pools: Vec<ModelPool>,
    /// Live allocations: address to (pool, rounded size).
    live: BTreeMap<u64, (usize, u64)>,
    /// Pointers freed once, for double-free attempts.
    freed_pointers: Vec<u64>,
}

impl Model {
    fn new() -> Self {
        Self {
            streams: vec![ModelStream::default(); STREAMS],
            events: vec![None; EVENTS],
            pools: vec![ModelPool::default(); POOLS],
            ..Self::default()
        }
    }

    fn frontier(&self, stream: usize) -> Clock {
        let mut clock = self.streams[stream].clock.clone();
        clock.insert(stream, self.streams[stream].position);
        clock
    }

    /// What the next operation on `stream` is ordered after: the legacy stream orders with the
    /// blocking stream both ways.
    fn op_clock(&self, stream: usize) -> Clock {
        let mut clock = self.streams[stream].clock.clone();
        if stream == LEGACY {
            join(&mut clock, &self.frontier(BLOCKING));
        } else if stream == BLOCKING {
            join(&mut clock, &self.frontier(LEGACY));
        }
        clock
    }

    fn commit(&mut self, stream: usize, clock: Clock) -> u64 {
        self.streams[stream].clock = clock;
        self.streams[stream].position += 1;
        self.streams[stream].position
    }

    fn observe(&mut self, clock: &Clock) {
        join(&mut self.completed, clock);
    }

    fn synchronize(&mut self, clock: &Clock) {
        self.observe(clock);
        for pool in 0..POOLS {
            if self.pools[pool].reserved > self.pools[pool].threshold {
                let threshold = self.pools[pool].threshold;
                self.trim(pool, threshold);
            }
        }
    }

    /// Whether the unit at `base` holds nothing live and only frees observed complete.
    fn is_idle(&self, pool: usize, base: u64) -> bool {
        let overlaps = |start: u64, len: u64| start < base + UNIT && base < start + len;
        let p = &self.pools[pool];
        !self.live.iter().any(|(&addr, &(owner, size))| owner == pool && overlaps(addr, size))
            && p.freed.iter().filter(|f| overlaps(f.start, f.len)).all(|f| get(&self.completed, f.stream) >= f.position)
    }

    /// The units of `pool` whose memory an allocation on `stream` (ordered after `knowledge`)
    /// that maps units outside `touched` may move, highest address first: nothing live in
    /// them, and every free in them one `stream` may reuse.
    fn movable(&self, pool: usize, stream: usize, knowledge: &Clock, touched: &[u64]) -> Vec<u64> {
        let overlaps = |base: u64, start: u64, len: u64| start < base + UNIT && base < start + len;
        let p = &self.pools[pool];
        let reusable = |f: &Freed| {
            f.stream == stream
                || get(&self.completed, f.stream) >= f.position
                || (p.follow_events && get(knowledge, f.stream) > 0 && get(knowledge, f.stream) >= f.position)
        };
        p.units
            .iter()
            .rev()
            .copied()
            .filter(|base| !touched.contains(base))
            .filter(|&base| {
                !self.live.iter().any(|(&addr, &(owner, size))| owner == pool && overlaps(base, addr, size))
            })
            .filter(|&base| p.freed.iter().filter(|f| overlaps(base, f.start, f.len)).all(reusable))
            .collect()
    }

    fn release(&mut self, pool: usize, base: u64) {
        let p = &mut self.pools[pool];
        p.units.remove(&base);
        p.reserved -= UNIT;
    }

    /// Idle units go, highest address first, while at least `keep` bytes remain.
    fn trim(&mut self, pool: usize, keep: u64) {
        let idle: Vec<u64> =
            self.pools[pool].units.iter().rev().copied().filter(|&base| self.is_idle(pool, base)).collect();
        for base in idle {
            if self.pools[pool].reserved < keep + UNIT {
                break;
            }
            self.release(pool, base);
        }
    }

    fn device_reserved(&self) -> u64 {
        self.pools.iter().map(|p| p.reserved).sum()
    }

    /// The device's release before it fails to map: every idle unit goes.
    fn release_idle_everywhere(&mut self) {
        for pool in 0..POOLS {
            self.trim(pool, 0);
        }
    }

    /// Records a free. Adjacent frees of one stream that are both still outstanding become one
    /// range that waits for the later free, as the device merges them.
    fn free(&mut self, pool: usize, mut freed: Freed) {
        loop {
            let completed = &self.completed;
            let neighbour = self.pools[pool].freed.iter().position(|f| {
                f.stream == freed.stream
                    && get(completed, f.stream) < f.position
                    && (f.start + f.len == freed.start || freed.start + freed.len == f.start)
            });
            let Some(index) = neighbour else { break };
            let f = self.pools[pool].freed.swap_remove(index);
            freed = Freed {
                start: f.start.min(freed.start),
                len: f.len + freed.len,
                position: f.position.max(freed.position),
                ..freed
            };
        }
        self.pools[pool].freed.push(freed);
    }

    /// Removes `[start, start + len)` from the freed ranges of `pool`.
    fn carve(&mut self, pool: usize, start: u64, len: u64) {
        let end = start + len;
        let mut kept = Vec::new();
        for f in self.pools[pool].freed.drain(..) {
            let f_end = f.start + f.len;
            if f_end <= start || f.start >= end {
                kept.push(f);
                continue;
            }
            if f.start < start {
                kept.push(Freed { len: start - f.start, ..f });
            }
            if f_end > end {
                kept.push(Freed { start: end, len: f_end - end, ..f });
            }
        }
        self.pools[pool].freed = kept;
    }
}

struct Harness {
    driver: Driver,
    streams: Vec<CUstream>,
    events: Vec<CUevent>,
    pools: Vec<CUmemoryPool>,
    model: Model,
}

impl Harness {
    fn new() -> Self {
        let config = SimConfig { granule: GRANULE, pool_unit: Some(UNIT), ..SimConfig::with_capacity(CAPACITY) };
        let driver = Driver::simulated(config).unwrap();
        let ctx = driver.primary_context_retain(0).unwrap();
        // SAFETY: `ctx` was just retained from this driver.
        unsafe { driver.context_set_current(ctx) }.unwrap();
        let non_blocking = CUstream_flags::CU_STREAM_NON_BLOCKING;
        let streams = vec![
            driver.stream_create(non_blocking).unwrap(),
            driver.stream_create(non_blocking).unwrap(),
            driver.stream_create(CUstream_flags::CU_STREAM_DEFAULT).unwrap(),
            CU_STREAM_LEGACY,
        ];
        let events =
            (0..EVENTS).map(|_| driver.event_create(CUevent_flags::CU_EVENT_DISABLE_TIMING).unwrap()).collect();
        let pools = (0..POOLS).map(|_| driver.mem_pool_create(&PoolProps::device(0).build()).unwrap()).collect();
        Self { driver, streams, events, pools, model: Model::new() }
    }

    fn layout(&self, pool: usize) -> PoolLayout {
        self.driver.sim().unwrap().pool_layout(self.pools[pool]).unwrap()
    }

    fn set(&self, pool: usize, attribute: CUmemPool_attribute, value: u64) {
        // SAFETY: the pool belongs to this harness's driver.
        unsafe { self.driver.mem_pool_set_attribute(self.pools[pool], attribute, value) }.unwrap();
    }

    fn apply(&mut self, op: &Op) -> Result<(), TestCaseError> {
        match *op {
            Op::Alloc { pool, stream, bytes } => self.alloc(pool, stream, bytes)?,
            Op::Free { pick, stream } => {
                if self.model.live.is_empty() {
                    return Ok(());
                }
                let (&ptr, &(pool, size)) = self.model.live.iter().nth(pick % self.model.live.len()).unwrap();
                // SAFETY: a live allocation of this driver, freed once; nothing uses it.
                unsafe { self.driver.mem_free_async(ptr, self.streams[stream]) }.unwrap();
                let m = &mut self.model;
                let clock = m.op_clock(stream);
                let position = m.commit(stream, clock);
                m.live.remove(&ptr);
                m.pools[pool].used -= size;
                m.free(pool, Freed { start: ptr, len: size, stream, position });
                m.freed_pointers.push(ptr);
            }
            Op::FreeAgain { pick, stream } => {
                let stale: Vec<u64> =
                    self.model.freed_pointers.iter().copied().filter(|p| !self.model.live.contains_key(p)).collect();
                if stale.is_empty() {
                    return Ok(());
                }
                let ptr = stale[pick % stale.len()];
                // SAFETY: the simulated device looks the pointer up and refuses it.
                let result = unsafe { self.driver.mem_free_async(ptr, self.streams[stream]) };
                prop_assert_eq!(result.unwrap_err().code(), Some(CUresult::CUDA_ERROR_INVALID_VALUE));
            }
            Op::Record { event, stream } => {
                // SAFETY: event and stream belong to this driver.
                unsafe { self.driver.event_record(self.events[event], self.streams[stream]) }.unwrap();
                let clock = self.model.op_clock(stream);
                self.model.commit(stream, clock);
                self.model.events[event] = Some(self.model.frontier(stream));
            }
            Op::Wait { stream, event } => {
                // SAFETY: event and stream belong to this driver.
                unsafe { self.driver.stream_wait_event(self.streams[stream], self.events[event]) }.unwrap();
                let mut clock = self.model.op_clock(stream);
                if let Some(recorded) = &self.model.events[event] {
                    join(&mut clock, recorded);
                }
                self.model.commit(stream, clock);
            }
            Op::SyncStream { stream } => {
                // SAFETY: the stream belongs to this driver.
                unsafe { self.driver.stream_synchronize(self.streams[stream]) }.unwrap();
                let clock = self.model.frontier(stream);
                self.model.synchronize(&clock);
            }
            Op::SyncEvent { event } => {
                // SAFETY: the event belongs to this driver.
                unsafe { self.driver.event_synchronize(self.events[event]) }.unwrap();
                if let Some(clock) = self.model.events[event].clone() {
                    self.model.synchronize(&clock);
                }
            }
            Op::SyncContext => {
                self.driver.context_synchronize().unwrap();
                let mut clock = Clock::new();
                for stream in 0..STREAMS {
                    join(&mut clock, &self.model.frontier(stream));
                }
                self.model.synchronize(&clock);
            }
            Op::Query { stream } => {
                // SAFETY: the stream belongs to this driver.
                let done = unsafe { self.driver.stream_query(self.streams[stream]) }.unwrap();
                prop_assert!(done, "the simulated device runs work in zero time");
                let clock = self.model.frontier(stream);
                self.model.observe(&clock);
            }
            Op::Trim { pool, keep } => {
                // SAFETY: the pool belongs to this driver.
                unsafe { self.driver.mem_pool_trim_to(self.pools[pool], keep) }.unwrap();
                self.model.trim(pool, keep);
            }
            Op::Threshold { pool, bytes } => {
                self.set(pool, CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, bytes);
                self.model.pools[pool].threshold = bytes;
            }
            Op::FollowEvents { pool, on } => {
                self.set(pool, CUmemPool_attribute::CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES, u64::from(on));
                self.model.pools[pool].follow_events = on;
            }
            Op::Internal { pool, on } => {
                self.set(pool, CUmemPool_attribute::CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES, u64::from(on));
                self.model.pools[pool].internal = on;
            }
        }
        self.check()
    }

    fn alloc(&mut self, pool: usize, stream: usize, bytes: u64) -> Result<(), TestCaseError> {
        // SAFETY: pool and stream belong to this driver.
        let result =
            unsafe { self.driver.mem_alloc_from_pool_async(bytes as usize, self.pools[pool], self.streams[stream]) };
        let ranges = self.layout(pool).ranges;
        let m = &mut self.model;
        let size = bytes.next_multiple_of(ALIGNMENT);
        // The most units a request can need: its size in units, plus one where it straddles; the
        // device maps units only while a granule stays free beside them.
        let most = size.next_multiple_of(UNIT) + UNIT + GRANULE;
        let knowledge = m.op_clock(stream);
        let ptr: CUdeviceptr = match result {
            Ok(ptr) => ptr,
            Err(error) => {
                prop_assert_eq!(error.code(), Some(CUresult::CUDA_ERROR_OUT_OF_MEMORY), "{}", error);
                // Mapping failed, so the device released every idle unit first.
                m.release_idle_everywhere();
                prop_assert!(m.device_reserved() + most > CAPACITY, "out of memory with room for {} bytes", most);
                return Ok(());
            }
        };
        prop_assert_eq!(ptr % ALIGNMENT, 0);
        if let Some((&other, &(_, other_size))) = m.live.range(..ptr + size).next_back() {
            prop_assert!(other + other_size <= ptr, "{:#x}+{} overlaps live {:#x}+{}", ptr, size, other, other_size);
        }
        let range = ranges.iter().copied().find(|&(base, len)| base <= ptr && ptr + size <= base + len);
        let Some((range_base, _)) = range else {
            return Err(TestCaseError::fail(format!("{ptr:#x}+{size} lies in none of the ranges {ranges:x?}")));
        };
        let first = range_base + (ptr - range_base) / UNIT * UNIT;
        let touched: Vec<u64> = (first..ptr + size).step_by(UNIT as usize).collect();

        let mut clock = knowledge.clone();
        // Reuse: every free the allocation covers must be ordered before it, or come from one
        // stream whose work this stream now waits for (an internal dependency).
        let follow = m.pools[pool].follow_events;
        let unordered: Vec<Freed> = m.pools[pool]
            .freed
            .iter()
            .copied()
            .filter(|f| f.start < ptr + size && ptr < f.start + f.len)
            .filter(|f| {
                f.stream != stream
                    && get(&m.completed, f.stream) < f.position
                    && !(follow && get(&knowledge, f.stream) >= f.position)
            })
            .collect();
        let missing = |m: &Model| touched.iter().filter(|base| !m.pools[pool].units.contains(base)).count();
        // Idle units' memory moves to the units the request maps, as far as it goes.
        let moved = |m: &Model| {
            let mut movable = m.movable(pool, stream, &knowledge, &touched);
            movable.truncate(missing(m));
            movable
        };
        let new = |m: &Model| (missing(m) - moved(m).len()) as u64 * UNIT;
        // Reserved bytes shrink during an allocation only where the device released idle units
        // before mapping: for the piece it placed in, or for a first choice it could not map. The
        // model cannot know that first choice, so it takes the release as observed and checks that
        // the request's units might not have fit.
        let reserved_now = CAPACITY - self.driver.mem_get_info().unwrap().0;
        let released = reserved_now < m.device_reserved() + new(m);
        if released && unordered.is_empty() {
            prop_assert!(m.device_reserved() + most > CAPACITY, "released idle units with room for {} bytes", most);
            m.release_idle_everywhere();
        }
        if let Some(first) = unordered.first() {
            prop_assert!(m.pools[pool].internal, "reused an unordered free without internal dependencies");
            prop_assert!(unordered.iter().all(|f| f.stream == first.stream), "frees of several streams");
            // Its first choice could not be mapped, so the device released every idle unit.
            m.release_idle_everywhere();
            prop_assert!(
                m.device_reserved() + most > CAPACITY,
                "an internal dependency with room to grow: {} reserved, at most {} more needed",
                m.device_reserved(),
                most
            );
            join(&mut clock, &m.frontier(first.stream));
        } else if new(m) > 0 && m.device_reserved() + new(m) + GRANULE > CAPACITY {
            m.release_idle_everywhere();
        }
        let grow = new(m);
        prop_assert!(grow == 0 || m.device_reserved() + grow + GRANULE <= CAPACITY, "mapped past capacity");
        for base in moved(m) {
            m.pools[pool].units.remove(&base);
        }
        let p = &mut m.pools[pool];
        p.units.extend(touched.iter().copied());
        p.reserved += grow;
        p.reserved_high = p.reserved_high.max(p.reserved);
        m.carve(pool, ptr, size);
        m.commit(stream, clock);
        m.live.insert(ptr, (pool, size));
        let p = &mut m.pools[pool];
        p.used += size;
        p.used_high = p.used_high.max(p.used);
        Ok(())
    }

    fn check(&self) -> Result<(), TestCaseError> {
        let mut reserved = 0;
        for pool in 0..POOLS {
            // SAFETY: the pool belongs to this driver.
            let counters = unsafe { self.driver.mem_pool_counters(self.pools[pool]) }.unwrap();
            let p = &self.model.pools[pool];
            prop_assert_eq!(
                (counters.used, counters.used_high, counters.reserved, counters.reserved_high),
                (p.used, p.used_high, p.reserved, p.reserved_high),
                "pool {} counters (used, used high, reserved, reserved high)",
                pool
            );
            let layout = self.layout(pool);
            let model_live: Vec<(u64, u64)> =
                self.model.live.iter().filter(|(_, (owner, _))| *owner == pool).map(|(&a, &(_, s))| (a, s)).collect();
            prop_assert_eq!(&layout.allocations, &model_live, "pool {} live allocations", pool);
            let mut model_mapped: Vec<(u64, u64)> = Vec::new();
            for &base in &p.units {
                match model_mapped.last_mut() {
                    Some((start, size)) if *start + *size == base => *size += UNIT,
                    _ => model_mapped.push((base, UNIT)),
                }
            }
            prop_assert_eq!(&layout.mapped, &model_mapped, "pool {} mapped units", pool);
            reserved += counters.reserved;
        }
        prop_assert!(reserved <= CAPACITY);
        let (free, total) = self.driver.mem_get_info().unwrap();
        prop_assert_eq!((free, total), (CAPACITY - reserved, CAPACITY));
        Ok(())
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn the_simulated_device_follows_the_model(ops in prop::collection::vec(op(), 1..80)) {
        let mut harness = Harness::new();
        for op in &ops {
            harness.apply(op)?;
        }
        // Drain: free everything, synchronize, and the device must give it all back.
        while !harness.model.live.is_empty() {
            harness.apply(&Op::Free { pick: 0, stream: 0 })?;
        }
        harness.apply(&Op::SyncContext)?;
        for pool in 0..POOLS {
            harness.apply(&Op::Trim { pool, keep: 0 })?;
        }
        prop_assert_eq!(harness.driver.mem_get_info().unwrap().0, CAPACITY, "everything released");
    }
}
