//! `cargo xtask codegen`: generates `sys/src/bindings.rs` from NVIDIA's `cuda.h`.
//!
//! The header comes from the PyPI wheel `nvidia-cuda-runtime-cu12` and libclang from the PyPI wheel
//! `libclang`, both pinned by version and SHA-256 and downloaded with `pip` into the target folder.
//! Neither is ever committed: the CUDA EULA does not let us redistribute `cuda.h`. The standard C
//! headers that `cuda.h` includes are replaced by two tiny stand-ins written here, so the output
//! depends only on the pinned inputs and not on the machine's C toolchain.
//!
//! bindgen sees the header after its `#define cuMemGetInfo cuMemGetInfo_v2` renames, so the
//! generated entry points carry the versioned symbol names the driver exports. The `extern "C"`
//! block bindgen writes is replaced by a `FunctionTable` of optional function pointers: nothing
//! links against CUDA, and a symbol that an older driver lacks is a `None`, not a load failure.

use std::collections::BTreeSet;
use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail, ensure};
use proc_macro2::TokenStream;
use quote::{format_ident, quote};

/// Whether to write the bindings or only compare them with the committed file.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Mode {
    Write,
    Check,
}

/// A pinned wheel: `pip download` checks the hash.
struct Wheel {
    requirement: &'static str,
    sha256: &'static str,
    /// Path of the member we need, matched as a suffix of the zip entry name.
    member: &'static str,
}

const CUDA_WHEEL: Wheel = Wheel {
    requirement: "nvidia-cuda-runtime-cu12==12.9.79",
    sha256: "25bba2dfb01d48a9b59ca474a1ac43c6ebf7011f1b0b8cc44f54eb6ac48a96c3",
    member: "nvidia/cuda_runtime/include/cuda.h",
};

const LIBCLANG_WHEEL: Wheel = Wheel {
    requirement: "libclang==18.1.1",
    sha256: "c533091d8a3bbf7460a00cb6c1a71da93bffe148f172c7d03b1c31fbf8aa2a0b",
    member: "clang/native/libclang.so",
};

/// `CUDA_VERSION` of the pinned header.
const CUDA_VERSION: u32 = 12090;

/// The entry points steppool binds, by their exported (versioned) names.
const FUNCTIONS: &[&str] = &[
    // Errors.
    "cuGetErrorName",
    "cuGetErrorString",
    // Initialization, version, devices.
    "cuInit",
    "cuDriverGetVersion",
    "cuDeviceGet",
    "cuDeviceGetCount",
    "cuDeviceGetName",
    "cuDeviceGetAttribute",
    "cuDeviceTotalMem_v2",
    "cuDeviceCanAccessPeer",
    // Primary context and current context.
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease_v2",
    "cuCtxGetCurrent",
    "cuCtxSetCurrent",
    "cuCtxPushCurrent_v2",
    "cuCtxPopCurrent_v2",
    "cuCtxGetDevice",
    "cuCtxSynchronize",
    // Streams.
    "cuStreamCreate",
    "cuStreamDestroy_v2",
    "cuStreamSynchronize",
    "cuStreamQuery",
    "cuStreamWaitEvent",
    "cuStreamGetCtx",
    // Events.
    "cuEventCreate",
    "cuEventDestroy_v2",
    "cuEventRecord",
    "cuEventQuery",
    "cuEventSynchronize",
    "cuEventElapsedTime",
    // Memory: information, the synchronous fallback, a stream-ordered memset.
    "cuMemGetInfo_v2",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
    "cuMemsetD8Async",
    // Stream-ordered allocation and memory pools.
    "cuMemAllocAsync",
    "cuMemFreeAsync",
    "cuMemAllocFromPoolAsync",
    "cuMemPoolCreate",
    "cuMemPoolDestroy",
    "cuMemPoolTrimTo",
    "cuMemPoolSetAttribute",
    "cuMemPoolGetAttribute",
    "cuMemPoolSetAccess",
    "cuMemPoolGetAccess",
    "cuDeviceGetDefaultMemPool",
    "cuDeviceGetMemPool",
    "cuDeviceSetMemPool",
    "cuMemPoolExportToShareableHandle",
    "cuMemPoolImportFromShareableHandle",
    "cuMemPoolExportPointer",
    "cuMemPoolImportPointer",
    // Virtual memory management: reserved address ranges with physical memory mapped on demand
    // (a slab that grows in place).
    "cuMemAddressReserve",
    "cuMemAddressFree",
    "cuMemCreate",
    "cuMemRelease",
    "cuMemMap",
    "cuMemUnmap",
    "cuMemSetAccess",
    "cuMemGetAllocationGranularity",
    // Modules and kernel launch, for the benchmark kernels.
    "cuModuleLoadData",
    "cuModuleUnload",
    "cuModuleGetFunction",
    "cuLaunchKernel",
    // Stream capture and graphs: capture status, instantiation and launch, graph memory.
    "cuStreamBeginCapture_v2",
    "cuStreamEndCapture",
    "cuStreamIsCapturing",
    "cuStreamGetCaptureInfo_v2",
    "cuThreadExchangeStreamCaptureMode",
    "cuGraphInstantiateWithFlags",
    "cuGraphLaunch",
    "cuGraphExecDestroy",
    "cuGraphDestroy",
    "cuDeviceGraphMemTrim",
    "cuDeviceGetGraphMemAttribute",
    "cuDeviceSetGraphMemAttribute",
];

/// Enumerations bound beyond those the functions pull in.
const TYPES: &[&str] = &[
    "CUdevice_attribute",
    "CUmemPool_attribute",
    "CUstream_flags",
    "CUevent_flags",
    "CUevent_wait_flags",
    "CUmemAccess_flags",
    "CUmemLocationType",
    "CUmemAllocationType",
    "CUmemAllocationHandleType",
    // Stream capture and graphs.
    "CUstreamCaptureMode",
    "CUstreamCaptureStatus",
    "CUgraphMem_attribute",
    "CUgraphInstantiate_flags",
    "CUmemAllocationGranularity_flags",
];

/// Stand-ins for the two standard headers `cuda.h` includes; the types come from clang's builtins.
const STDLIB_H: &str = "typedef __SIZE_TYPE__ size_t;\n";
const STDINT_H: &str = "\
typedef __INT8_TYPE__ int8_t;
typedef __INT16_TYPE__ int16_t;
typedef __INT32_TYPE__ int32_t;
typedef __INT64_TYPE__ int64_t;
typedef __UINT8_TYPE__ uint8_t;
typedef __UINT16_TYPE__ uint16_t;
typedef __UINT32_TYPE__ uint32_t;
typedef __UINT64_TYPE__ uint64_t;
typedef __INTPTR_TYPE__ intptr_t;
typedef __UINTPTR_TYPE__ uintptr_t;
";

const BINDINGS: &str = "sys/src/bindings.rs";

pub(crate) fn run(mode: Mode) -> Result<()> {
    let work = crate::target_dir().join("xtask-codegen");
    fs::create_dir_all(&work).with_context(|| format!("creating {}", work.display()))?;

    let header = extract(&download(&work, &CUDA_WHEEL)?, &CUDA_WHEEL, &work.join("cuda"))?;
    let header_text = fs::read_to_string(&header)?;
    ensure!(
        header_text.contains(&format!("#define CUDA_VERSION {CUDA_VERSION}")),
        "{} is not the CUDA {CUDA_VERSION} header the bindings are pinned to",
        header.display()
    );
    let libclang_dir = libclang(&work)?;

    let include = work.join("include");
    fs::create_dir_all(&include)?;
    fs::write(include.join("stdlib.h"), STDLIB_H)?;
    fs::write(include.join("stdint.h"), STDINT_H)?;

    let raw = bindgen_output(&header, &include, &libclang_dir)?;
    let generated = postprocess(&raw)?;

    let path = crate::project_root().join(BINDINGS);
    match mode {
        Mode::Write => {
            fs::write(&path, &generated).with_context(|| format!("writing {}", path.display()))?;
            println!("wrote {BINDINGS} ({} lines)", generated.lines().count());
        }
        Mode::Check => {
            let committed = fs::read_to_string(&path).unwrap_or_default();
            if committed != generated {
                let first = committed
                    .lines()
                    .zip(generated.lines())
                    .position(|(a, b)| a != b)
                    .unwrap_or_else(|| committed.lines().count().min(generated.lines().count()))
                    + 1;
                bail!(
                    "{BINDINGS} differs from a fresh generation (first difference at line {first}): \
                     run `cargo xtask codegen` and commit the result"
                );
            }
            println!("{BINDINGS} is current");
        }
    }
    Ok(())
}

/// Downloads a pinned wheel with pip (which verifies the hash) unless it is already there.
fn download(work: &Path, wheel: &Wheel) -> Result<PathBuf> {
    let dir = work.join("wheels");
    fs::create_dir_all(&dir)?;
    let (name, version) = wheel.requirement.split_once("==").expect("pinned requirement");
    let stem = format!("{}-{version}-", name.replace('-', "_"));
    if let Some(found) = find_wheel(&dir, &stem)? {
        return Ok(found);
    }
    let requirements = work.join(format!("{name}.requirements.txt"));
    fs::write(&requirements, format!("{} --hash=sha256:{}\n", wheel.requirement, wheel.sha256))?;
    let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".to_owned());
    let status = Command::new(&python)
        .args(["-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:"])
        .args(["--platform", "manylinux2014_x86_64", "--python-version", "3.11"])
        .args(["--require-hashes", "--dest"])
        .arg(&dir)
        .arg("-r")
        .arg(&requirements)
        .status()
        .with_context(|| format!("running `{python} -m pip` (set PYTHON to another interpreter)"))?;
    ensure!(status.success(), "pip could not download {} ({status})", wheel.requirement);
    find_wheel(&dir, &stem)?.with_context(|| format!("pip reported success but no {stem}*.whl is in {}", dir.display()))
}

fn find_wheel(dir: &Path, stem: &str) -> Result<Option<PathBuf>> {
    for entry in fs::read_dir(dir)? {
        let path = entry?.path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or_default();
        if name.starts_with(stem) && name.ends_with(".whl") {
            return Ok(Some(path));
        }
    }
    Ok(None)
}

/// Extracts the wheel member `wheel.member` into `dest`, returning the extracted file.
fn extract(archive: &Path, wheel: &Wheel, dest: &Path) -> Result<PathBuf> {
    let file = fs::File::open(archive)?;
    let mut zip = zip::ZipArchive::new(file).with_context(|| format!("reading {}", archive.display()))?;
    let index = (0..zip.len())
        .find(|&i| zip.name_for_index(i).is_some_and(|n| n.ends_with(wheel.member)))
        .with_context(|| format!("{} has no {}", archive.display(), wheel.member))?;
    let mut member = zip.by_index(index)?;
    let mut bytes = Vec::with_capacity(member.size() as usize);
    member.read_to_end(&mut bytes)?;
    let file_name = Path::new(wheel.member).file_name().expect("member has a file name");
    fs::create_dir_all(dest)?;
    let out = dest.join(file_name);
    fs::write(&out, bytes)?;
    Ok(out)
}

/// The folder holding libclang: `LIBCLANG_PATH` when set, else the pinned wheel's copy (x86-64 only).
fn libclang(work: &Path) -> Result<PathBuf> {
    if let Some(dir) = std::env::var_os("LIBCLANG_PATH") {
        return Ok(PathBuf::from(dir));
    }
    ensure!(
        cfg!(all(target_os = "linux", target_arch = "x86_64")),
        "the pinned libclang wheel is for x86-64 Linux; set LIBCLANG_PATH to a folder holding libclang"
    );
    let out = extract(&download(work, &LIBCLANG_WHEEL)?, &LIBCLANG_WHEEL, &work.join("libclang"))?;
    Ok(out.parent().expect("extracted into a folder").to_path_buf())
}

fn bindgen_output(header: &Path, include: &Path, libclang_dir: &Path) -> Result<String> {
    // SAFETY: xtask is single-threaded here; nothing reads the environment concurrently.
    unsafe { std::env::set_var("LIBCLANG_PATH", libclang_dir) };
    let exact = |names: &[&str]| format!("^({})$", names.join("|"));
    let bindings = bindgen::Builder::default()
        .header(header.to_string_lossy())
        .clang_args(["-x", "c", "-nostdinc", "--target=x86_64-unknown-linux-gnu"])
        .clang_arg(format!("-I{}", include.display()))
        .allowlist_function(exact(FUNCTIONS))
        .allowlist_type(exact(TYPES))
        .allowlist_var("^CUDA_VERSION$")
        .default_enum_style(bindgen::EnumVariation::NewType { is_bitfield: false, is_global: false })
        .bitfield_enum("CUmemAllocationHandleType_enum")
        .derive_default(true)
        .derive_eq(true)
        .derive_hash(true)
        .generate_comments(false)
        .layout_tests(true)
        .merge_extern_blocks(true)
        .formatter(bindgen::Formatter::None)
        .generate()
        .map_err(|e| anyhow::anyhow!("bindgen failed on {}: {e}", header.display()))?;
    Ok(bindings.to_string())
}

/// Replaces bindgen's `extern "C"` block by the function table and adds `CUresult` names.
fn postprocess(raw: &str) -> Result<String> {
    let file = syn::parse_file(raw).context("parsing bindgen output")?;
    let mut items = Vec::new();
    let mut functions = Vec::new();
    let mut result_codes: Vec<(String, u32)> = Vec::new();
    for item in file.items {
        match item {
            syn::Item::ForeignMod(block) => {
                for foreign in block.items {
                    if let syn::ForeignItem::Fn(f) = foreign {
                        functions.push(f.sig);
                    }
                }
            }
            syn::Item::Impl(ref block) if is_impl_of(block, "cudaError_enum") => {
                for member in &block.items {
                    if let syn::ImplItem::Const(c) = member {
                        result_codes.push((c.ident.to_string(), newtype_value(&c.expr)?));
                    }
                }
                items.push(item);
            }
            other => items.push(other),
        }
    }
    let missing: Vec<&str> =
        FUNCTIONS.iter().copied().filter(|f| !functions.iter().any(|sig| sig.ident == f)).collect();
    ensure!(missing.is_empty(), "cuda.h {CUDA_VERSION} does not declare {missing:?}");
    ensure!(!result_codes.is_empty(), "no CUresult constants in bindgen output");
    // Keep the order of FUNCTIONS, which groups the entry points by topic.
    functions.sort_by_key(|sig| FUNCTIONS.iter().position(|f| sig.ident == f));

    let fields = functions.iter().map(|sig| {
        let name = &sig.ident;
        let inputs = &sig.inputs;
        let output = &sig.output;
        quote! { pub #name: Option<unsafe extern "C" fn(#inputs) #output>, }
    });
    let resolvers = functions.iter().map(|sig| {
        let name = &sig.ident;
        let symbol = proc_macro2::Literal::byte_string(format!("{name}\0").as_bytes());
        quote! { #name: unsafe { library.get(#symbol) }.ok().map(|symbol| *symbol), }
    });
    let symbols = functions.iter().map(|sig| sig.ident.to_string());

    let mut seen = BTreeSet::new();
    let (names, c_names): (Vec<TokenStream>, Vec<TokenStream>) = result_codes
        .iter()
        .filter(|(_, value)| seen.insert(*value))
        .map(|(name, value)| {
            let c_name = proc_macro2::Literal::c_string(&std::ffi::CString::new(name.as_str()).expect("no NUL"));
            (quote! { #value => Some(#name), }, quote! { #value => Some(#c_name), })
        })
        .unzip();
    let ident = format_ident!("cudaError_enum");

    let generated = quote! {
        #(#items)*

        /// The CUDA driver entry points steppool uses, resolved from a loaded library.
        ///
        /// A field is `None` when the library does not export that symbol (an older driver).
        /// Each field has the signature `cuda.h` declares for the exported, versioned name.
        #[derive(Clone, Copy, Default, Debug)]
        pub struct FunctionTable {
            #(#fields)*
        }

        impl FunctionTable {
            /// The exported names of the entry points, in field order.
            pub const SYMBOLS: &'static [&'static str] = &[#(#symbols),*];

            /// Resolves every entry point from `library`; a symbol it lacks becomes `None`.
            ///
            /// # Safety
            ///
            /// `library` must be a CUDA driver library: each symbol of these names must be the
            /// driver function `cuda.h` declares, with that signature.
            pub unsafe fn resolve(library: &::libloading::Library) -> Self {
                // SAFETY: the caller guarantees each named symbol has the declared signature.
                Self { #(#resolvers)* }
            }
        }

        impl #ident {
            /// The name `cuda.h` gives this code, or `None` for a code the header does not know.
            pub const fn name(self) -> Option<&'static str> {
                match self.0 { #(#names)* _ => None }
            }

            /// [`Self::name`] as a NUL-terminated string, as `cuGetErrorName` returns it.
            pub const fn c_name(self) -> Option<&'static ::std::ffi::CStr> {
                match self.0 { #(#c_names)* _ => None }
            }
        }
    };
    let file = syn::parse2::<syn::File>(generated).context("re-parsing generated bindings")?;
    let header = format!(
        "//! Raw CUDA driver API: types and entry points. Generated by `cargo xtask codegen`; do not edit.\n\
         //!\n\
         //! Input: `cuda.h` (CUDA_VERSION {CUDA_VERSION}) from the PyPI wheel `{cuda}`, read by bindgen {bindgen}\n\
         //! through libclang from `{clang}`, for 64-bit targets. The header itself is not committed.\n\
         #![allow(non_camel_case_types, non_snake_case, non_upper_case_globals, missing_docs)]\n\
         #![allow(unreachable_pub, clippy::all, clippy::undocumented_unsafe_blocks)]\n\n",
        cuda = CUDA_WHEEL.requirement,
        bindgen = bindgen_version(raw)?,
        clang = LIBCLANG_WHEEL.requirement,
    );
    Ok(header + &prettyplease::unparse(&file))
}

fn is_impl_of(block: &syn::ItemImpl, name: &str) -> bool {
    block.trait_.is_none() && matches!(&*block.self_ty, syn::Type::Path(p) if p.path.is_ident(name))
}

/// Reads `N` out of a bindgen newtype constant `Type(N)`.
fn newtype_value(expr: &syn::Expr) -> Result<u32> {
    if let syn::Expr::Call(call) = expr
        && let Some(syn::Expr::Lit(syn::ExprLit { lit: syn::Lit::Int(int), .. })) = call.args.first()
        && call.args.len() == 1
    {
        return Ok(int.base10_parse()?);
    }
    bail!("unexpected CUresult constant form: {}", quote!(#expr))
}

/// The bindgen version, read from the banner bindgen writes at the top of its output.
fn bindgen_version(raw: &str) -> Result<&str> {
    raw.lines()
        .find_map(|line| line.split("automatically generated by rust-bindgen ").nth(1))
        .map(|rest| rest.trim_end_matches("*/").trim())
        .context("bindgen output has no version banner")
}
