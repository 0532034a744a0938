//! Saved plans: the packed scopes of a planned phase, kept from one run (or made from a trace with
//! `steppool plan`) and loaded by the next, so that a planned run is planned from its first step.
//!
//! A [`PlanFile`] holds, per phase (by name), the plans its pools had recorded: for each plan the
//! key that selects it, its slab size, and every entry in allocation order with its size, its
//! lifetime (positions of its allocation and free in the recorded sequence) and its offset in the
//! slab. The runtime exports them (`Runtime::saved_plans`) and loads them into a phase
//! (`PhaseSpec::plans`, `Runtime::load_plans`); this module owns the model, its checks and (feature
//! `jsonl`) its file format.
//!
//! # File format, version 1
//!
//! One JSON document (UTF-8), written by [`PlanFile::to_json`]:
//!
//! ```json
//! {
//!   "format": "steppool-plans",
//!   "version": 1,
//!   "phases": [
//!     {
//!       "phase": "step",
//!       "plans": [
//!         {
//!           "key": { "sizes": [4096, 8192] },
//!           "bytes": 12288,
//!           "varies": false,
//!           "blocks": [
//!             { "size": 4096, "start": 0, "end": 2, "offset": 8192 },
//!             { "size": 8192, "start": 1, "offset": 0 },
//!             { "size": 2048, "start": 3, "end": 4, "offset": 8192 }
//!           ]
//!         }
//!       ]
//!     }
//!   ]
//! }
//! ```
//!
//! - `key` is `{"sizes": [...]}` (the first sizes of the scope, rounded up to 512 bytes: a scope
//!   whose first sizes are these is served from the plan) or `{"user": N}` (the key given with
//!   `Runtime::set_plan_key`).
//! - `blocks` are the scope's allocations in allocation order: `size` in bytes (a positive multiple
//!   of [`ALIGNMENT`]), `start` and `end` the positions of the allocation and of its free in the
//!   recorded sequence of allocations and frees (distinct, `start` increasing from block to block,
//!   `end` after `start`; no `end` for a block alive until the scope's end), `offset` in the slab.
//! - `bytes` is the slab: at least the highest `offset + size`.
//! - `varies`: the scope was seen again with the same allocations and frees but other sizes, and
//!   each block is sized to the largest seen (a larger request than its block is then that block
//!   grown, never a later block of its size).
//! - `received` and `carries` (optional, `false` when left out), in a phase that carries: the
//!   scope received memory the scope before carried into it, and it carried memory into the next
//!   (the plan was packed with it). Two plans may share a key where one has `received` and the
//!   other not (the training steps after and before an evaluation step whose gradients live
//!   through it); a scope prefers the one that agrees with it.
//! - Unknown fields are refused, so a misspelt field is named rather than ignored.
//!
//! # Checks
//!
//! [`PlanFile::from_json`] refuses a file whose syntax or fields are wrong
//! ([`PlanFileError::Json`], with its line and column), of another format or version, or with a
//! plan that could hand out overlapping memory: [`PhasePlans::validate`] checks each block and, with
//! [`packing::first_conflict`], that no two blocks alive at the same time share a byte and that
//! every block lies in the slab. The runtime validates plans again when a phase spec carries them,
//! whatever their origin.

#[cfg(feature = "jsonl")]
use serde::{Deserialize, Serialize};

use crate::packing::{self, Block, Conflict, Packing};

/// The alignment of every planned size and offset: the runtime's allocation alignment.
pub const ALIGNMENT: u64 = 512;

/// The `format` of a plan file.
pub const FORMAT: &str = "steppool-plans";

/// The version this crate writes.
pub const VERSION: u64 = 1;

/// The versions this crate reads.
pub const READS_VERSIONS: [u64; 1] = [1];

/// What selects a plan.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "jsonl", derive(Serialize, Deserialize), serde(rename_all = "snake_case"))]
#[non_exhaustive]
pub enum PlanKey {
    /// A key the user gave with `Runtime::set_plan_key` (a sequence-length bucket, say).
    User(u64),
    /// The first sizes of the scope, rounded up to the 512-byte alignment.
    Sizes(Vec<u64>),
}

/// One entry of a plan: an allocation of the recorded scope and its place in the slab.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "jsonl", derive(Serialize, Deserialize), serde(deny_unknown_fields))]
pub struct PlannedBlock {
    /// Bytes, a multiple of [`ALIGNMENT`].
    pub size: u64,
    /// Position of its allocation in the recorded sequence.
    pub start: u32,
    /// Position of its free; `None` when it lived until the scope's end.
    #[cfg_attr(feature = "jsonl", serde(default, skip_serializing_if = "Option::is_none"))]
    pub end: Option<u32>,
    /// Its offset in the slab.
    pub offset: u64,
}

impl PlannedBlock {
    /// The block as the packer sees it.
    pub fn block(&self) -> Block {
        Block { size: self.size, start: self.start, end: self.end.unwrap_or(Block::NEVER_FREED) }
    }
}

/// One packed scope.
#[derive(Clone, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "jsonl", derive(Serialize, Deserialize), serde(deny_unknown_fields))]
pub struct SavedPlan {
    /// What selects it.
    pub key: PlanKey,
    /// The slab it needs, in bytes.
    pub bytes: u64,
    /// Its blocks are sized to the largest size seen in their place over scopes with the same
    /// allocations and frees.
    #[cfg_attr(feature = "jsonl", serde(default))]
    pub varies: bool,
    /// Its scope received memory the scope before carried into it (a phase that carries): one
    /// key may have a plan that did and one that did not (the training steps after and before an
    /// evaluation step whose gradients live through it), and a scope prefers the plan that
    /// agrees with it.
    #[cfg_attr(feature = "jsonl", serde(default, skip_serializing_if = "std::ops::Not::not"))]
    pub received: bool,
    /// Its scope carried memory into the next (a phase that carries), and the plan was packed
    /// with it: the kind of scope, with `received`.
    #[cfg_attr(feature = "jsonl", serde(default, skip_serializing_if = "std::ops::Not::not"))]
    pub carries: bool,
    /// Its entries, in allocation order.
    pub blocks: Vec<PlannedBlock>,
}

impl SavedPlan {
    /// The blocks as the packer sees them.
    pub fn packer_blocks(&self) -> Vec<Block> {
        self.blocks.iter().map(PlannedBlock::block).collect()
    }

    /// The peak of live bytes of its blocks: no slab for them can be smaller.
    pub fn lower_bound(&self) -> u64 {
        packing::lower_bound(&self.packer_blocks())
    }
}

/// The plans of one phase.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "jsonl", derive(Serialize, Deserialize), serde(deny_unknown_fields))]
pub struct PhasePlans {
    /// The phase's name.
    pub phase: String,
    /// Its plans, most recently used first.
    pub plans: Vec<SavedPlan>,
}

impl PhasePlans {
    /// Checks that every plan can be served as it is: a key of aligned sizes no larger than the
    /// blocks they select, blocks of aligned positive sizes and offsets with distinct positions,
    /// allocations in order, each freed after it is made, inside the slab, and no two blocks
    /// alive at the same time overlapping; no two plans with one key and the same `received`.
    pub fn validate(&self) -> Result<(), PlanFileError> {
        let invalid = |plan: usize, reason: String| PlanFileError::Invalid { phase: self.phase.clone(), plan, reason };
        for (index, plan) in self.plans.iter().enumerate() {
            if plan.blocks.is_empty() {
                return Err(invalid(index, "a plan needs at least one block".to_owned()));
            }
            if let Some(other) =
                self.plans[..index].iter().position(|p| p.key == plan.key && p.received == plan.received)
            {
                return Err(invalid(
                    index,
                    format!("the same key and `received` ({}) as plan {other}: {:?}", plan.received, plan.key),
                ));
            }
            let mut positions = Vec::with_capacity(plan.blocks.len() * 2);
            for (b, block) in plan.blocks.iter().enumerate() {
                if block.size == 0 || block.size % ALIGNMENT != 0 {
                    return Err(invalid(
                        index,
                        format!("block {b} is {} bytes: use a positive multiple of {ALIGNMENT}", block.size),
                    ));
                }
                if block.offset % ALIGNMENT != 0 {
                    return Err(invalid(
                        index,
                        format!("block {b} at offset {}: use a multiple of {ALIGNMENT}", block.offset),
                    ));
                }
                if let Some(end) = block.end
                    && (end <= block.start || end == Block::NEVER_FREED)
                {
                    return Err(invalid(
                        index,
                        format!(
                            "block {b} starts at {} and ends at {end}: a block ends after it starts (leave `end` out for one alive to the scope's end)",
                            block.start
                        ),
                    ));
                }
                if b > 0 && block.start <= plan.blocks[b - 1].start {
                    return Err(invalid(
                        index,
                        format!(
                            "block {b} starts at {} after block {} at {}: blocks are in allocation order",
                            block.start,
                            b - 1,
                            plan.blocks[b - 1].start
                        ),
                    ));
                }
                positions.push(block.start);
                positions.extend(block.end);
            }
            positions.sort_unstable();
            if let Some(pair) = positions.windows(2).find(|pair| pair[0] == pair[1]) {
                return Err(invalid(
                    index,
                    format!("two events at position {}: each allocation and free has its own", pair[0]),
                ));
            }
            if let PlanKey::Sizes(sizes) = &plan.key {
                if sizes.is_empty() || sizes.len() > plan.blocks.len() {
                    return Err(invalid(
                        index,
                        format!(
                            "a key of {} sizes for {} blocks: use 1 to {}",
                            sizes.len(),
                            plan.blocks.len(),
                            plan.blocks.len()
                        ),
                    ));
                }
                for (i, (&size, block)) in sizes.iter().zip(&plan.blocks).enumerate() {
                    if size == 0 || size % ALIGNMENT != 0 || size > block.size {
                        return Err(invalid(
                            index,
                            format!(
                                "key size {i} is {size} bytes for block {i} of {} bytes: use a positive multiple of {ALIGNMENT} no larger than the block",
                                block.size
                            ),
                        ));
                    }
                }
            }
            let packing = Packing { offsets: plan.blocks.iter().map(|b| b.offset).collect(), size: plan.bytes };
            let describe = |b: usize| {
                let block = &plan.blocks[b];
                let end = block.end.map_or("the scope's end".to_owned(), |end| end.to_string());
                format!("block {b} ({} bytes at offset {}, alive {} to {end})", block.size, block.offset, block.start)
            };
            match packing::first_conflict(&plan.packer_blocks(), &packing) {
                None => {}
                Some(Conflict::Overlap { first, second }) => {
                    return Err(invalid(
                        index,
                        format!("{} and {} overlap while both are alive", describe(first), describe(second)),
                    ));
                }
                Some(Conflict::OutsideSlab { block }) => {
                    return Err(invalid(
                        index,
                        format!("{} reaches past the slab of {} bytes", describe(block), plan.bytes),
                    ));
                }
                Some(conflict) => return Err(invalid(index, format!("not a valid packing: {conflict:?}"))),
            }
        }
        Ok(())
    }
}

/// The plans of a run, per phase.
#[derive(Clone, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "jsonl", derive(Serialize, Deserialize), serde(deny_unknown_fields))]
pub struct PlanFile {
    /// Always [`FORMAT`].
    pub format: String,
    /// The version it is written in.
    pub version: u64,
    /// The phases, each once.
    pub phases: Vec<PhasePlans>,
}

impl Default for PlanFile {
    fn default() -> Self {
        Self { format: FORMAT.to_owned(), version: VERSION, phases: Vec::new() }
    }
}

impl PlanFile {
    /// A file of these phases' plans, in the current version.
    pub fn new(phases: Vec<PhasePlans>) -> Self {
        Self { phases, ..Self::default() }
    }

    /// The plans of the phase named `name`.
    pub fn phase(&self, name: &str) -> Option<&PhasePlans> {
        self.phases.iter().find(|p| p.phase == name)
    }

    /// Checks the format, the version, that each phase appears once, and every phase's plans
    /// ([`PhasePlans::validate`]).
    pub fn validate(&self) -> Result<(), PlanFileError> {
        if self.format != FORMAT {
            return Err(PlanFileError::Format { found: self.format.clone() });
        }
        if !READS_VERSIONS.contains(&self.version) {
            return Err(PlanFileError::Version { found: self.version, supported: READS_VERSIONS.to_vec() });
        }
        for (index, phase) in self.phases.iter().enumerate() {
            if self.phases[..index].iter().any(|p| p.phase == phase.phase) {
                return Err(PlanFileError::DuplicatePhase { phase: phase.phase.clone() });
            }
            phase.validate()?;
        }
        Ok(())
    }

    /// Reads and [validates](PlanFile::validate) a plan file.
    #[cfg(feature = "jsonl")]
    pub fn from_json(text: &str) -> Result<Self, PlanFileError> {
        let json = |error: serde_json::Error| {
            let (line, column) = (error.line(), error.column());
            let message = error.to_string();
            let position = format!(" at line {line} column {column}");
            let message = message.strip_suffix(&position).unwrap_or(&message).to_owned();
            PlanFileError::Json { line, column, message }
        };
        // The header first, so that another format or version is named as such rather than by
        // the first field it lacks.
        #[derive(Deserialize)]
        struct Header {
            format: Option<String>,
            version: Option<u64>,
        }
        let header: Header = serde_json::from_str(text).map_err(json)?;
        match (header.format, header.version) {
            (Some(format), _) if format != FORMAT => return Err(PlanFileError::Format { found: format }),
            (_, Some(version)) if !READS_VERSIONS.contains(&version) => {
                return Err(PlanFileError::Version { found: version, supported: READS_VERSIONS.to_vec() });
            }
            _ => {}
        }
        let file: PlanFile = serde_json::from_str(text).map_err(json)?;
        file.validate()?;
        Ok(file)
    }

    /// The file as JSON, one block per line.
    #[cfg(feature = "jsonl")]
    pub fn to_json(&self) -> String {
        let mut out = String::new();
        out +=
            &format!("{{\n  \"format\": {},\n  \"version\": {},\n  \"phases\": [", quote(&self.format), self.version);
        for (p, phase) in self.phases.iter().enumerate() {
            out += if p == 0 { "\n" } else { ",\n" };
            out += &format!("    {{\n      \"phase\": {},\n      \"plans\": [", quote(&phase.phase));
            for (i, plan) in phase.plans.iter().enumerate() {
                out += if i == 0 { "\n" } else { ",\n" };
                out += &format!(
                    "        {{\n          \"key\": {},\n          \"bytes\": {},\n          \"varies\": {},\n{}          \"blocks\": [",
                    serde_json::to_string(&plan.key).unwrap_or_default(),
                    plan.bytes,
                    plan.varies,
                    [(plan.received, "received"), (plan.carries, "carries")]
                        .iter()
                        .filter(|(set, _)| *set)
                        .map(|(_, field)| format!("          \"{field}\": true,\n"))
                        .collect::<String>()
                );
                for (b, block) in plan.blocks.iter().enumerate() {
                    out += if b == 0 { "\n" } else { ",\n" };
                    out += "            ";
                    out += &serde_json::to_string(block).unwrap_or_default();
                }
                out += "\n          ]\n        }";
            }
            out += "\n      ]\n    }";
        }
        out += "\n  ]\n}\n";
        out
    }
}

#[cfg(feature = "jsonl")]
fn quote(text: &str) -> String {
    serde_json::to_string(text).unwrap_or_default()
}

/// Why a plan file or a phase's plans cannot be used.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PlanFileError {
    /// Not JSON, or a field missing, misspelt or of the wrong type.
    #[error("line {line}, column {column}: {message}")]
    Json {
        /// The line, from 1.
        line: usize,
        /// The column, from 1.
        column: usize,
        /// What the parser said (it names the field).
        message: String,
    },
    /// Another format.
    #[error("format `{found}` is not a plan file (expected `{FORMAT}`)")]
    Format {
        /// The format the file names.
        found: String,
    },
    /// A version this crate does not read.
    #[error("plan file version {found} is not supported; this steppool reads version {supported:?}")]
    Version {
        /// The version the file names.
        found: u64,
        /// The versions read.
        supported: Vec<u64>,
    },
    /// A phase appears twice.
    #[error("phase `{phase}` appears twice")]
    DuplicatePhase {
        /// The phase.
        phase: String,
    },
    /// A plan cannot be served as it is.
    #[error("phase `{phase}`, plan {plan}: {reason}")]
    Invalid {
        /// The phase.
        phase: String,
        /// The plan's index in the phase, from 0.
        plan: usize,
        /// What is wrong, with the numbers.
        reason: String,
    },
}

#[cfg(all(test, feature = "jsonl"))]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn block(size: u64, start: u32, end: Option<u32>, offset: u64) -> PlannedBlock {
        PlannedBlock { size, start, end, offset }
    }

    fn file() -> PlanFile {
        PlanFile::new(vec![PhasePlans {
            phase: "step".to_owned(),
            plans: vec![
                SavedPlan {
                    key: PlanKey::Sizes(vec![4096, 8192]),
                    bytes: 12288,
                    varies: false,
                    received: false,
                    carries: true,
                    blocks: vec![block(4096, 0, Some(2), 8192), block(8192, 1, None, 0), block(2048, 3, Some(4), 8192)],
                },
                SavedPlan {
                    key: PlanKey::User(7),
                    bytes: 1024,
                    varies: true,
                    received: false,
                    carries: false,
                    blocks: vec![block(1024, 0, Some(1), 0)],
                },
                // The first plan's key, for the scopes that received carried memory.
                SavedPlan {
                    key: PlanKey::Sizes(vec![4096, 8192]),
                    bytes: 12288,
                    varies: false,
                    received: true,
                    carries: false,
                    blocks: vec![block(4096, 0, None, 0), block(8192, 1, Some(2), 4096)],
                },
            ],
        }])
    }

    #[test]
    fn a_file_reads_back_as_it_was_written() {
        let file = file();
        file.validate().unwrap();
        let text = file.to_json();
        assert_eq!(PlanFile::from_json(&text).unwrap(), file);
        assert_eq!(file.phase("step").unwrap().plans[0].lower_bound(), 12288);
        assert!(text.contains(r#"{"size":8192,"start":1,"offset":0}"#), "{text}");
    }

    #[test]
    fn syntax_and_field_errors_name_the_line() {
        let text = file().to_json().replacen("\"offset\":0", "\"ofset\":0", 1);
        match PlanFile::from_json(&text) {
            Err(PlanFileError::Json { line, message, .. }) => {
                assert_eq!(line, 15, "{message}");
                assert_eq!(message, "unknown field `ofset`, expected one of `size`, `start`, `end`, `offset`");
            }
            other => panic!("{other:?}"),
        }
        let text = file().to_json().replacen("\"bytes\": 12288", "\"bytes\": -1", 1);
        assert!(matches!(PlanFile::from_json(&text), Err(PlanFileError::Json { line: 10, .. })));
    }

    #[test]
    fn another_format_or_version_is_named() {
        let text = file().to_json().replacen("\"version\": 1", "\"version\": 9", 1);
        assert_eq!(PlanFile::from_json(&text), Err(PlanFileError::Version { found: 9, supported: vec![1] }));
        let text = r#"{"format":"steppool-trace","version":1}"#;
        assert_eq!(PlanFile::from_json(text), Err(PlanFileError::Format { found: "steppool-trace".to_owned() }));
    }

    #[test]
    fn overlapping_or_malformed_plans_are_refused_with_their_numbers() {
        let error = |edit: &dyn Fn(&mut SavedPlan)| {
            let mut file = file();
            edit(&mut file.phases[0].plans[0]);
            let text = file.to_json();
            let error = PlanFile::from_json(&text).unwrap_err();
            assert_eq!(file.validate().unwrap_err(), error, "the same check either way");
            error.to_string()
        };
        // Block 2 placed over block 1 while both are alive.
        let message = error(&|plan| plan.blocks[2].offset = 0);
        assert_eq!(
            message,
            "phase `step`, plan 0: block 1 (8192 bytes at offset 0, alive 1 to the scope's end) and block 2 (2048 bytes at offset 0, alive 3 to 4) overlap while both are alive"
        );
        let message = error(&|plan| plan.bytes = 8192);
        assert!(
            message.contains("block 0 (4096 bytes at offset 8192, alive 0 to 2) reaches past the slab of 8192 bytes"),
            "{message}"
        );
        let message = error(&|plan| plan.blocks[0].size = 100);
        assert!(message.contains("block 0 is 100 bytes"), "{message}");
        let message = error(&|plan| plan.blocks[0].end = Some(0));
        assert!(message.contains("block 0 starts at 0 and ends at 0"), "{message}");
        let message = error(&|plan| plan.blocks[2].start = 2);
        assert!(message.contains("two events at position 2"), "{message}");
        let message = error(&|plan| plan.blocks[1].start = 0);
        assert!(message.contains("blocks are in allocation order"), "{message}");
        let message = error(&|plan| plan.key = PlanKey::Sizes(vec![8192]));
        assert!(message.contains("key size 0 is 8192 bytes for block 0 of 4096 bytes"), "{message}");
        let message = error(&|plan| plan.key = PlanKey::User(7));
        assert!(message.contains("the same key and `received` (false) as plan 0"), "{message}");
        let message = error(&|plan| plan.received = true);
        assert!(message.contains("plan 2: the same key and `received` (true) as plan 0"), "{message}");
    }

    #[test]
    fn a_phase_named_twice_is_refused() {
        let mut file = file();
        file.phases.push(file.phases[0].clone());
        assert_eq!(
            PlanFile::from_json(&file.to_json()),
            Err(PlanFileError::DuplicatePhase { phase: "step".to_owned() })
        );
    }

    /// A plan packed from a random sequence of allocations and frees, as the planned strategy
    /// packs a recorded scope.
    fn packed() -> impl Strategy<Value = SavedPlan> {
        prop::collection::vec((1u64..64, any::<bool>(), any::<prop::sample::Index>()), 1..80).prop_map(|ops| {
            let mut blocks: Vec<Block> = Vec::new();
            let mut live: Vec<usize> = Vec::new();
            for (position, (size, allocate, pick)) in ops.into_iter().enumerate() {
                if allocate || live.is_empty() {
                    live.push(blocks.len());
                    blocks.push(Block { size: size * ALIGNMENT, start: position as u32, end: Block::NEVER_FREED });
                } else {
                    blocks[live.swap_remove(pick.index(live.len()))].end = position as u32;
                }
            }
            let packing = packing::pack(&blocks);
            SavedPlan {
                key: PlanKey::Sizes(blocks.iter().take(4).map(|b| b.size).collect()),
                bytes: packing.size,
                varies: false,
                received: false,
                carries: false,
                blocks: blocks
                    .iter()
                    .zip(&packing.offsets)
                    .map(|(b, &offset)| PlannedBlock {
                        size: b.size,
                        start: b.start,
                        end: (b.end != Block::NEVER_FREED).then_some(b.end),
                        offset,
                    })
                    .collect(),
            }
        })
    }

    proptest! {
        #[test]
        fn packed_plans_are_valid_and_read_back_unchanged(plan in packed(), shift in 0u64..4) {
            let file = PlanFile::new(vec![PhasePlans { phase: "p".to_owned(), plans: vec![plan.clone()] }]);
            prop_assert_eq!(PlanFile::from_json(&file.to_json()), Ok(file.clone()));
            // Any block moved onto a block alive at the same time is refused.
            let blocks = plan.packer_blocks();
            if let Some((a, b)) = (0..blocks.len())
                .flat_map(|a| (0..blocks.len()).map(move |b| (a, b)))
                .find(|&(a, b)| a != b && blocks[a].overlaps_in_time(&blocks[b]))
            {
                let mut moved = file.clone();
                let block = &mut moved.phases[0].plans[0].blocks[b];
                // Inside `a`'s range: a quarter step of it at a time.
                block.offset = plan.blocks[a].offset + plan.blocks[a].size / ALIGNMENT * shift / 4 * ALIGNMENT;
                let refused = PlanFile::from_json(&moved.to_json());
                prop_assert!(matches!(refused, Err(PlanFileError::Invalid { plan: 0, .. })), "{:?}", refused);
            }
        }
    }
}
