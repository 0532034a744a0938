//! What the simulated device looks like: how many devices, their capacity, the granule and the
//! pools' unit of reservation, and the driver it pretends to be.

use super::faults::{FaultPlan, FaultPlanError};
use crate::bytes::{Bytes, ParseBytesError, parse_bytes};

/// The capacity of the default simulated device: an 80 GiB H100/A100.
pub const DEFAULT_CAPACITY: u64 = 80 << 30;
/// The default granularity of physical memory: of `cuMemAlloc`'s reservations and of virtual
/// memory management (`cuMemGetAllocationGranularity`).
pub const DEFAULT_GRANULE: u64 = 2 << 20;
/// The default unit in which stream-ordered pools map device memory: 32 MiB, as measured on an
/// H200 (driver 580.159.04; `benches/results/2026-11-27-h200-calibration.md`).
pub const DEFAULT_POOL_UNIT: u64 = 32 << 20;
/// The driver version the simulated device reports by default (CUDA 12.9).
pub const DEFAULT_DRIVER_VERSION: i32 = 12090;
/// The largest capacity one simulated device may have: its slice of the simulated address space.
pub const MAX_CAPACITY: u64 = 1 << 46;
/// The most devices one simulated driver may have.
pub const MAX_DEVICES: usize = 64;

/// Configuration of a simulated driver and its devices.
///
/// [`SimConfig::default`] is one 80 GiB device with 2 MiB granules and 32 MiB pool units that
/// supports memory pools and virtual memory management; [`SimConfig::from_env`] reads
/// `STEPPOOL_SIM_DEVICES`, `STEPPOOL_SIM_GRANULE`, `STEPPOOL_SIM_POOL_UNIT`, `STEPPOOL_SIM_VMM`,
/// `STEPPOOL_SIM_HOST_MEMORY` and `STEPPOOL_SIM_FAULTS` over that.
#[derive(Clone, Debug, PartialEq)]
pub struct SimConfig {
    /// Capacity in bytes of each device, by ordinal.
    pub capacities: Vec<u64>,
    /// Granularity of physical memory: the unit of `cuMemAlloc`'s reservations and of virtual
    /// memory management; a multiple of 512 bytes.
    pub granule: u64,
    /// How stream-ordered pools (`cuMemPoolCreate`, the device's default pool) reserve device
    /// memory. `Some(unit)` (the default, [`DEFAULT_POOL_UNIT`], as an H200's driver answered): a
    /// pool is one address range grown in units of `unit` bytes (a multiple of 512), with
    /// allocations placed across unit boundaries. `None`, the segment model (the simulated
    /// device's model before it was calibrated, kept for comparison and for small worked
    /// examples): each growth reserves a segment of the request rounded up to the granule, and
    /// allocations never span two segments.
    pub pool_unit: Option<u64>,
    /// The version `cuDriverGetVersion` reports, as `1000 * major + 10 * minor`.
    pub driver_version: i32,
    /// What `CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED` reports; without it the pool calls
    /// return `CUDA_ERROR_NOT_SUPPORTED`, as on vGPU slices and Windows TCC drivers.
    pub memory_pools_supported: bool,
    /// Whether devices may access each other's pools (`cuDeviceCanAccessPeer`).
    pub peer_access: bool,
    /// What `CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED` reports. On by default, as
    /// every H100, H200 and A100 answers, so the runtime places memory as it would on such a GPU
    /// (planned slabs, persistent chunks and arenas as address ranges that grow in place). Off
    /// (`STEPPOOL_SIM_VMM=0`), the virtual memory management calls (`cuMemAddressReserve`,
    /// `cuMemCreate`, `cuMemMap`, ...) return `CUDA_ERROR_NOT_SUPPORTED`, as on devices and
    /// drivers that lack them, and the runtime takes pool slabs and chunks instead.
    pub vmm_supported: bool,
    /// Whether device memory is backed by host memory, so that memset, copies and the
    /// repository's fill kernels have effect (`STEPPOOL_SIM_HOST_MEMORY=1`). Off by default: a
    /// simulated 80 GiB device then costs no memory, and copies out of the device are refused
    /// with `CUDA_ERROR_NOT_SUPPORTED`. When on, each reserved segment takes zeroed host memory
    /// of its size (pages are touched only when written), and a segment the host cannot back is
    /// an out-of-memory error.
    pub host_memory: bool,
    /// Calls made to fail (`STEPPOOL_SIM_FAULTS`, see [`FaultPlan::parse`]); none by default.
    pub faults: Option<FaultPlan>,
    /// Whether the driver counts its calls by entry point ([`Sim::calls`](super::Sim::calls)), a
    /// test facility. Off by default: a count is a lock and a map update on every call, a third
    /// of a simulated allocation's cost. `STEPPOOL_SIM_CALLS=PATH` turns it on too.
    pub count_calls: bool,
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            capacities: vec![DEFAULT_CAPACITY],
            granule: DEFAULT_GRANULE,
            pool_unit: Some(DEFAULT_POOL_UNIT),
            driver_version: DEFAULT_DRIVER_VERSION,
            memory_pools_supported: true,
            peer_access: true,
            vmm_supported: true,
            host_memory: false,
            faults: None,
            count_calls: false,
        }
    }
}

/// Why a simulated-device configuration was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SimConfigError {
    /// `STEPPOOL_SIM_DEVICES` could not be read.
    #[error(
        "STEPPOOL_SIM_DEVICES=`{value}` is not a device list: write capacities such as `80GiB`, \
         `2x80GiB` or `80GiB,40GiB`"
    )]
    Devices {
        /// The value that was read.
        value: String,
    },
    /// A size could not be read.
    #[error("{variable}: {source}")]
    Size {
        /// The variable that held it.
        variable: &'static str,
        /// What was wrong with it.
        source: ParseBytesError,
    },
    /// A switch (`STEPPOOL_SIM_HOST_MEMORY`, `STEPPOOL_SIM_VMM`) is neither on nor off.
    #[error("{variable}=`{value}` is not a switch: write `1` (or `true`, `on`) or `0` (or `false`, `off`)")]
    Switch {
        /// The variable that held it.
        variable: &'static str,
        /// The value that was read.
        value: String,
    },
    /// `STEPPOOL_SIM_FAULTS` could not be read.
    #[error(transparent)]
    Faults(#[from] FaultPlanError),
    /// A device capacity is zero or beyond [`MAX_CAPACITY`].
    #[error("device {device} has capacity {capacity} bytes; a simulated device holds 1 byte to 64 TiB")]
    Capacity {
        /// The device ordinal.
        device: usize,
        /// The capacity asked for.
        capacity: u64,
    },
    /// No devices, or more than [`MAX_DEVICES`].
    #[error("{count} simulated devices asked for; between 1 and 64 are supported")]
    DeviceCount {
        /// The number asked for.
        count: usize,
    },
    /// The granule is zero or not a multiple of 512 bytes.
    #[error("a granule of {granule} bytes is not a positive multiple of 512 bytes")]
    Granule {
        /// The granule asked for.
        granule: u64,
    },
    /// The pool unit is zero or not a multiple of 512 bytes.
    #[error("a pool unit of {unit} bytes is not a positive multiple of 512 bytes")]
    PoolUnit {
        /// The unit asked for.
        unit: u64,
    },
}

impl SimConfig {
    /// One device of `capacity` bytes, otherwise the defaults.
    pub fn with_capacity(capacity: u64) -> Self {
        Self { capacities: vec![capacity], ..Self::default() }
    }

    /// The defaults, overridden by `STEPPOOL_SIM_DEVICES` (for example `2x80GiB`),
    /// `STEPPOOL_SIM_GRANULE` (for example `2MiB`), `STEPPOOL_SIM_POOL_UNIT` (a size such as
    /// `32MiB`, or `segments`; see [`parse_pool_unit`]), `STEPPOOL_SIM_VMM` (`0` for a device without
    /// virtual memory management, `1` by default), `STEPPOOL_SIM_HOST_MEMORY` (`1` or `0`) and
    /// `STEPPOOL_SIM_FAULTS` where they are set.
    pub fn from_env() -> Result<Self, SimConfigError> {
        Self::from_variables(|variable| std::env::var(variable).ok())
    }

    /// [`SimConfig::from_env`] over the variables `lookup` answers.
    fn from_variables(lookup: impl Fn(&'static str) -> Option<String>) -> Result<Self, SimConfigError> {
        let mut config = Self::default();
        if let Some(value) = lookup("STEPPOOL_SIM_DEVICES") {
            config.capacities = parse_devices(&value)?;
        }
        if let Some(value) = lookup("STEPPOOL_SIM_GRANULE") {
            config.granule = parse_bytes(&value)
                .map_err(|source| SimConfigError::Size { variable: "STEPPOOL_SIM_GRANULE", source })?;
        }
        if let Some(value) = lookup("STEPPOOL_SIM_POOL_UNIT") {
            config.pool_unit = parse_pool_unit(&value)
                .map_err(|source| SimConfigError::Size { variable: "STEPPOOL_SIM_POOL_UNIT", source })?;
        }
        let switch = |variable: &'static str| match lookup(variable) {
            Some(value) if !value.trim().is_empty() => {
                parse_switch(&value).map(Some).ok_or(SimConfigError::Switch { variable, value })
            }
            _ => Ok(None),
        };
        if let Some(on) = switch("STEPPOOL_SIM_VMM")? {
            config.vmm_supported = on;
        }
        if let Some(on) = switch("STEPPOOL_SIM_HOST_MEMORY")? {
            config.host_memory = on;
        }
        if let Some(value) = lookup("STEPPOOL_SIM_FAULTS")
            && !value.trim().is_empty()
        {
            config.faults = Some(FaultPlan::parse(&value)?);
        }
        config.validate()?;
        Ok(config)
    }

    /// Checks the limits documented on each field.
    pub fn validate(&self) -> Result<(), SimConfigError> {
        let count = self.capacities.len();
        if count == 0 || count > MAX_DEVICES {
            return Err(SimConfigError::DeviceCount { count });
        }
        for (device, &capacity) in self.capacities.iter().enumerate() {
            if capacity == 0 || capacity > MAX_CAPACITY {
                return Err(SimConfigError::Capacity { device, capacity });
            }
        }
        if self.granule == 0 || !self.granule.is_multiple_of(512) {
            return Err(SimConfigError::Granule { granule: self.granule });
        }
        if let Some(unit) = self.pool_unit
            && (unit == 0 || !unit.is_multiple_of(512))
        {
            return Err(SimConfigError::PoolUnit { unit });
        }
        Ok(())
    }

    /// A one-line description, such as `2 × 80 GiB, 2 MiB granules` (with `, 32 MiB pool units`
    /// where pools grow in units and `, no virtual memory management` where it is off).
    pub fn describe(&self) -> String {
        let mut groups: Vec<(usize, u64)> = Vec::new();
        for &capacity in &self.capacities {
            match groups.last_mut() {
                Some((count, last)) if *last == capacity => *count += 1,
                _ => groups.push((1, capacity)),
            }
        }
        let devices: Vec<String> =
            groups.iter().map(|(count, capacity)| format!("{count} × {}", Bytes(*capacity))).collect();
        let backed = if self.host_memory { ", host-backed" } else { "" };
        let vmm = if self.vmm_supported { "" } else { ", no virtual memory management" };
        let units = self.pool_unit.map(|unit| format!(", {} pool units", Bytes(unit))).unwrap_or_default();
        format!("{}, {} granules{units}{backed}{vmm}", devices.join(" + "), Bytes(self.granule))
    }
}

/// Reads how pools reserve memory ([`SimConfig::pool_unit`]): `segments` (any case) for the
/// segment model, otherwise a size such as `32MiB` for the unit.
pub fn parse_pool_unit(value: &str) -> Result<Option<u64>, ParseBytesError> {
    if value.trim().eq_ignore_ascii_case("segments") { Ok(None) } else { parse_bytes(value).map(Some) }
}

/// Reads an on/off switch: `1`, `true`, `on`, `yes` or `0`, `false`, `off`, `no`, any case.
fn parse_switch(value: &str) -> Option<bool> {
    match value.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "on" | "yes" => Some(true),
        "0" | "false" | "off" | "no" | "" => Some(false),
        _ => None,
    }
}

/// Reads a device list: comma-separated capacities, each optionally preceded by `Nx`.
fn parse_devices(value: &str) -> Result<Vec<u64>, SimConfigError> {
    let bad = || SimConfigError::Devices { value: value.to_owned() };
    let mut capacities = Vec::new();
    for item in value.split(',') {
        let item = item.trim();
        let (count, size) = match item.split_once(['x', 'X', '×']) {
            Some((count, size)) if count.trim().chars().all(|c| c.is_ascii_digit()) => {
                (count.trim().parse::<usize>().map_err(|_| bad())?, size)
            }
            _ => (1, item),
        };
        let capacity =
            parse_bytes(size).map_err(|source| SimConfigError::Size { variable: "STEPPOOL_SIM_DEVICES", source })?;
        if count > MAX_DEVICES || capacities.len() + count > MAX_DEVICES {
            return Err(SimConfigError::DeviceCount { count: capacities.len() + count });
        }
        capacities.extend(std::iter::repeat_n(capacity, count));
    }
    if capacities.is_empty() {
        return Err(bad());
    }
    Ok(capacities)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_lists() {
        assert_eq!(parse_devices("80GiB"), Ok(vec![80 << 30]));
        assert_eq!(parse_devices("2x80GiB"), Ok(vec![80 << 30, 80 << 30]));
        assert_eq!(parse_devices("80GiB, 1x40GiB"), Ok(vec![80 << 30, 40 << 30]));
        assert!(matches!(parse_devices("2xlots"), Err(SimConfigError::Size { .. })));
        assert!(matches!(parse_devices("100x1GiB"), Err(SimConfigError::DeviceCount { count: 100 })));
    }

    #[test]
    fn validation_names_the_numbers() {
        let mut config = SimConfig::with_capacity(0);
        assert_eq!(config.validate(), Err(SimConfigError::Capacity { device: 0, capacity: 0 }));
        config.capacities = vec![1 << 30];
        config.granule = 1000;
        let error = config.validate().unwrap_err();
        assert!(error.to_string().contains("1000 bytes"), "{error}");
        config.granule = DEFAULT_GRANULE;
        config.pool_unit = Some(0);
        let error = config.validate().unwrap_err();
        assert_eq!(error, SimConfigError::PoolUnit { unit: 0 });
        assert!(error.to_string().contains("pool unit of 0 bytes"), "{error}");
    }

    #[test]
    fn virtual_memory_management_is_on_unless_switched_off() {
        let with = |vmm: Option<&str>| {
            SimConfig::from_variables(|variable| {
                (variable == "STEPPOOL_SIM_VMM").then_some(vmm).flatten().map(str::to_owned)
            })
        };
        assert!(SimConfig::default().vmm_supported, "as every H100, H200 and A100 answers");
        assert!(with(None).unwrap().vmm_supported);
        assert!(with(Some("")).unwrap().vmm_supported, "empty is unset");
        assert!(with(Some("on")).unwrap().vmm_supported);
        assert!(!with(Some("0")).unwrap().vmm_supported);
        assert!(!with(Some("off")).unwrap().vmm_supported);
        let error = with(Some("sometimes")).unwrap_err();
        assert_eq!(error, SimConfigError::Switch { variable: "STEPPOOL_SIM_VMM", value: "sometimes".to_owned() });
        assert!(error.to_string().starts_with("STEPPOOL_SIM_VMM=`sometimes` is not a switch"), "{error}");
    }

    #[test]
    fn pools_grow_in_32_mib_units_unless_told_otherwise() {
        let with = |unit: Option<&str>| {
            SimConfig::from_variables(|variable| {
                (variable == "STEPPOOL_SIM_POOL_UNIT").then_some(unit).flatten().map(str::to_owned)
            })
        };
        assert_eq!(with(None).unwrap().pool_unit, Some(32 << 20), "as an H200's driver answered");
        assert_eq!(with(Some("4MiB")).unwrap().pool_unit, Some(4 << 20));
        assert_eq!(with(Some(" Segments ")).unwrap().pool_unit, None);
        assert!(matches!(with(Some("lots")), Err(SimConfigError::Size { variable: "STEPPOOL_SIM_POOL_UNIT", .. })));
        assert_eq!(with(Some("1000")), Err(SimConfigError::PoolUnit { unit: 1000 }));
    }

    #[test]
    fn switches() {
        assert_eq!(parse_switch(" On "), Some(true));
        assert_eq!(parse_switch("0"), Some(false));
        assert_eq!(parse_switch("maybe"), None);
    }

    #[test]
    fn describes_itself() {
        let config =
            SimConfig { capacities: vec![80 << 30, 80 << 30, 16 << 30], pool_unit: None, ..SimConfig::default() };
        assert_eq!(config.describe(), "2 × 80 GiB + 1 × 16 GiB, 2 MiB granules");
        let config = SimConfig { vmm_supported: false, ..SimConfig::with_capacity(1 << 30) };
        assert_eq!(config.describe(), "1 × 1 GiB, 2 MiB granules, 32 MiB pool units, no virtual memory management");
    }
}
