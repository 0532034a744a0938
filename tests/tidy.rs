//! Checks of the repository itself, run by `cargo test`: no build artefact is in git, the docs name
//! only paths that exist, `ARCHITECTURE.md`'s code map names every module, each compile-fail case
//! fails with the one error it is about, and the runtime's modules import one another one way only.
//!
//! They need no device. They read the checkout this crate sits in (its root is the parent of
//! `CARGO_MANIFEST_DIR`) and ask `git ls-files` which files it holds, so outside a git checkout, or
//! without `git` on `PATH`, they fail saying so (CI runs them in a clone).
//!
//! Markdown is read with `pulldown-cmark` and Rust with `syn`, because both get right what a line
//! scanner gets wrong: code spans broken across lines, fenced blocks and tables; `use` trees grouped,
//! nested and spread over lines, and `crate::` inside strings and comments, which is no import.
//! rustc's `.stderr` files and the `// expect:` comments are line formats and are read line by line.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

use proc_macro2::{TokenStream, TokenTree};
use pulldown_cmark::{Event, Options, Parser, Tag};
use syn::visit::{self, Visit};

// ---------------------------------------------------------------------------------------------
// The checkout

/// The repository root: the parent of this crate's folder.
fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("the tests crate sits in the repository root").to_path_buf()
}

/// `git ls-files -z ARGS` in the checkout, or a panic saying why the checks cannot run.
fn git_ls_files(args: &[&str]) -> Vec<String> {
    let root = root();
    let output = Command::new("git").arg("-C").arg(&root).args(["ls-files", "-z"]).args(args).output();
    let output = match output {
        Ok(output) if output.status.success() => output,
        Ok(output) => panic!(
            "the tidy checks read the repository's file list from git, but `git ls-files` failed in {}: {}\n\
             Run them in a git checkout (CI runs them in a clone).",
            root.display(),
            String::from_utf8_lossy(&output.stderr).trim()
        ),
        Err(error) => panic!(
            "the tidy checks read the repository's file list from git, but `git` could not be run: {error}\n\
             Install git and run them in a git checkout (CI runs them in a clone)."
        ),
    };
    String::from_utf8_lossy(&output.stdout).split('\0').filter(|path| !path.is_empty()).map(str::to_owned).collect()
}

/// The files a commit of the working tree would hold: tracked or untracked but not ignored, and on
/// disk (a tracked file deleted in the working tree is gone).
fn present_files() -> BTreeSet<String> {
    let root = root();
    git_ls_files(&["--cached", "--others", "--exclude-standard"])
        .into_iter()
        .filter(|path| root.join(path).is_file())
        .collect()
}

fn read(relative: &str) -> String {
    let path = root().join(relative);
    std::fs::read_to_string(&path).unwrap_or_else(|error| panic!("cannot read {}: {error}", path.display()))
}

// ---------------------------------------------------------------------------------------------
// 1. Build artefacts

/// What kind of build artefact `path` is, if it is one.
fn artefact_kind(path: &str) -> Option<&'static str> {
    let components: Vec<&str> = path.split('/').collect();
    let (name, folders) = components.split_last()?;
    if folders.contains(&"target") {
        return Some("cargo build output (under `target/`)");
    }
    if folders.contains(&"__pycache__") {
        return Some("Python bytecode cache (`__pycache__/`)");
    }
    if matches!(*name, "cuda.h" | "cuda_runtime_api.h" | "cuda_runtime.h") {
        return Some("NVIDIA header (the bindings are generated from it; it is never committed)");
    }
    let suffixes: Vec<&str> = name.split('.').skip(1).collect();
    match suffixes.last().copied() {
        Some("pyc") => Some("Python bytecode"),
        Some("o") => Some("object file"),
        Some("rlib" | "rmeta") => Some("compiled Rust library"),
        Some("whl") => Some("Python wheel"),
        Some("dylib" | "dll") => Some("shared library"),
        _ if suffixes.contains(&"so") => Some("shared library"),
        _ => None,
    }
}

/// No build output, Python bytecode, compiled library, wheel or NVIDIA header is tracked by git,
/// and none lies in the working tree unignored (where `git add` would pick it up).
#[test]
fn no_build_artefacts_are_in_git() {
    let listed = |paths: Vec<String>| -> String {
        paths
            .iter()
            .filter_map(|path| artefact_kind(path).map(|kind| format!("  {path}: {kind}\n")))
            .collect::<String>()
    };
    let tracked = listed(git_ls_files(&[]));
    let unignored = listed(git_ls_files(&["--others", "--exclude-standard"]));
    let mut problems = String::new();
    if !tracked.is_empty() {
        let _ = write!(
            problems,
            "build artefacts are tracked by git:\n{tracked}\
             Untrack them with `git rm -r --cached PATH` and make .gitignore ignore them.\n"
        );
    }
    if !unignored.is_empty() {
        let _ = write!(
            problems,
            "build artefacts are in the working tree and not ignored, so `git add` would commit them:\n{unignored}\
             Add a pattern for them to .gitignore.\n"
        );
    }
    assert!(problems.is_empty(), "{problems}");
}

#[test]
fn artefacts_are_recognized_and_sources_are_not() {
    for artefact in [
        "target/debug/steppool",
        "cli/target/x.d",
        "benches/peers/__pycache__/peers.cpython-311.pyc",
        "peers.pyc",
        "tests/fake/libcuda.so.1",
        "lib.so",
        "a.o",
        "libsteppool.rlib",
        "nvidia_cuda_runtime_cu12-12.9.79-py3-none-manylinux.whl",
        "sys/include/cuda.h",
        "cuda_runtime_api.h",
    ] {
        assert!(artefact_kind(artefact).is_some(), "{artefact} is an artefact");
    }
    for source in ["sys/src/bindings.rs", "tests/fake_driver/libcuda.rs", "benches/peers/peers.py", "README.md"] {
        assert_eq!(artefact_kind(source), None, "{source} is a source");
    }
}

// ---------------------------------------------------------------------------------------------
// 2. Paths named in the docs

/// The documents whose paths are checked.
const DOCS: [&str; 3] = ["README.md", "ARCHITECTURE.md", "benches/README.md"];

/// Extensions that make a code span with a `/` a path.
const PATH_EXTENSIONS: [&str; 18] = [
    "rs", "md", "toml", "py", "txt", "ptx", "lock", "json", "jsonl", "csv", "svg", "png", "pickle", "sh", "yml",
    "yaml", "h", "stderr",
];

/// Extensions that make a bare file name (no `/`) a path: the repository's own sources.
const NAME_EXTENSIONS: [&str; 7] = ["rs", "md", "toml", "py", "txt", "ptx", "lock"];

/// Characters that no path named in the docs contains: they mark commands, globs, placeholders,
/// Rust paths, assignments and lists.
const NOT_IN_PATHS: &str = "*?[]{}<>|=$,;:@#!\"'()`\\";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum MentionKind {
    CodeSpan,
    Link,
}

/// A code span or link destination of a document, with its line.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Mention {
    text: String,
    line: usize,
    kind: MentionKind,
}

/// Every inline code span and every link or image destination of `markdown` (fenced and indented
/// code blocks are commands and output, and are not read).
fn mentions(markdown: &str) -> Vec<Mention> {
    let mut found = Vec::new();
    for (event, range) in Parser::new_ext(markdown, Options::ENABLE_TABLES).into_offset_iter() {
        let line = markdown[..range.start].matches('\n').count() + 1;
        let (text, kind) = match event {
            Event::Code(code) => (code.trim().to_owned(), MentionKind::CodeSpan),
            Event::Start(Tag::Link { dest_url, .. } | Tag::Image { dest_url, .. }) => {
                (dest_url.to_string(), MentionKind::Link)
            }
            _ => continue,
        };
        found.push(Mention { text, line, kind });
    }
    found
}

/// The repository's files and the folders that hold them.
struct Tree {
    files: BTreeSet<String>,
    folders: BTreeSet<String>,
}

impl Tree {
    fn new(files: BTreeSet<String>) -> Self {
        let mut folders = BTreeSet::new();
        for file in &files {
            let mut end = 0;
            while let Some(slash) = file[end..].find('/') {
                end += slash;
                folders.insert(file[..end].to_owned());
                end += 1;
            }
        }
        Tree { files, folders }
    }

    fn has(&self, path: &str, folder: bool) -> bool {
        self.folders.contains(path) || (!folder && self.files.contains(path))
    }

    /// Whether some file (or folder) is `suffix` or ends with `/suffix`.
    fn has_suffix(&self, suffix: &str, folder: bool) -> bool {
        let ends = |entry: &String| entry == suffix || entry.ends_with(&format!("/{suffix}"));
        self.folders.iter().any(ends) || (!folder && self.files.iter().any(ends))
    }

    /// Whether some file or folder of the repository is called `name`.
    fn has_name(&self, name: &str) -> bool {
        self.has_suffix(name, false)
    }
}

/// `relative` joined to the folder `base` (both `/`-separated, relative to the root), `.` and `..`
/// resolved; `None` when it leaves the repository.
fn normalize(base: &str, relative: &str) -> Option<String> {
    let mut parts: Vec<&str> = base.split('/').filter(|part| !part.is_empty()).collect();
    for part in relative.split('/') {
        match part {
            "" | "." => {}
            ".." => {
                parts.pop()?;
            }
            part => parts.push(part),
        }
    }
    Some(parts.join("/"))
}

fn extension(name: &str) -> Option<&str> {
    name.rsplit_once('.').filter(|(stem, _)| !stem.is_empty()).map(|(_, extension)| extension)
}

/// What a mention is found to be.
#[derive(Debug, PartialEq, Eq)]
enum Verdict {
    /// Not a repository path (a command, an identifier, a URL, a placeholder, an output name...).
    NotAPath,
    Exists,
    Missing,
    /// A path outside the repository, which a clean clone does not have.
    Outside,
}

/// Whether `mention`, in the document in folder `doc_dir` (`""` for the root), names a
/// repository path, and if so whether it exists. The rule is documented on
/// [`docs_name_only_paths_that_exist`].
fn check_mention(mention: &Mention, doc_dir: &str, tree: &Tree) -> Verdict {
    let text = mention.text.as_str();
    let leaves_for_shared = text.split('/').collect::<Vec<_>>().windows(2).any(|pair| pair == ["..", "shared"]);
    match mention.kind {
        MentionKind::Link => {
            let path = text.split(['#', '?']).next().unwrap_or_default();
            if path.is_empty() || text.contains("://") || text.starts_with("mailto:") {
                return Verdict::NotAPath;
            }
            if leaves_for_shared {
                return Verdict::Outside;
            }
            let folder = path.ends_with('/');
            match normalize(doc_dir, path) {
                None => Verdict::Outside,
                Some(path) if tree.has(&path, folder) => Verdict::Exists,
                Some(_) => Verdict::Missing,
            }
        }
        MentionKind::CodeSpan => {
            if text.is_empty()
                || text.contains(char::is_whitespace)
                || text.contains(|c| NOT_IN_PATHS.contains(c))
                || text.starts_with(['/', '~'])
                || text.starts_with("./")
                || text == "target"
                || text.starts_with("target/")
            {
                return Verdict::NotAPath;
            }
            let folder = text.ends_with('/');
            let trimmed = text.trim_end_matches('/');
            let components: Vec<&str> = trimmed.split('/').collect();
            let last = components.last().copied().unwrap_or_default();
            let is_path = if text.contains('/') {
                text.starts_with("../")
                    || folder
                    || extension(last).is_some_and(|e| PATH_EXTENSIONS.contains(&e))
                    || tree.has_name(components[0])
            } else {
                extension(last).is_some_and(|e| NAME_EXTENSIONS.contains(&e))
            };
            if !is_path {
                return Verdict::NotAPath;
            }
            if leaves_for_shared {
                return Verdict::Outside;
            }
            if components.contains(&"..") {
                return match normalize(doc_dir, trimmed) {
                    None => Verdict::Outside,
                    Some(path) if tree.has(&path, folder) => Verdict::Exists,
                    Some(_) => Verdict::Missing,
                };
            }
            let path = normalize("", trimmed).unwrap_or_default();
            if tree.has_suffix(&path, folder) { Verdict::Exists } else { Verdict::Missing }
        }
    }
}

/// The problems of one document, one line each.
fn doc_problems(doc: &str, markdown: &str, tree: &Tree) -> Vec<String> {
    let doc_dir = doc.rsplit_once('/').map_or("", |(dir, _)| dir);
    let mut problems = Vec::new();
    for mention in mentions(markdown) {
        let what = match mention.kind {
            MentionKind::CodeSpan => format!("`{}`", mention.text),
            MentionKind::Link => format!("link ({})", mention.text),
        };
        let problem = match check_mention(&mention, doc_dir, tree) {
            Verdict::NotAPath | Verdict::Exists => continue,
            Verdict::Outside => format!(
                "{what} is outside the repository: a clean clone has no such path. Name a path in the \
                 repository instead (the training traces the project uses are in `cli/tests/data/`)"
            ),
            Verdict::Missing if mention.kind == MentionKind::Link => {
                format!("{what}: no such file or folder, relative to {doc}'s folder")
            }
            Verdict::Missing => format!(
                "{what}: no file or folder of the repository is (or ends with) this path; fix the name, \
                 or write it so it reads as no path (a command with its arguments, a <placeholder>)"
            ),
        };
        problems.push(format!("{doc}:{}: {problem}", mention.line));
    }
    problems
}

/// Every repository path that README.md, ARCHITECTURE.md and benches/README.md name exists.
///
/// What counts as a path, in the Markdown as CommonMark parses it (fenced and indented code blocks
/// hold commands and their output and are not read):
///
/// - A link or image destination, unless it is a URL (`scheme://`, `mailto:`) or only a `#fragment`.
///   It is resolved against the document's folder, as a Markdown viewer does, and must exist there.
/// - An inline code span, once trimmed, that holds no whitespace (a command line) and none of
///   ``*?[]{}<>|=$,;:@#!"'()`\`` (globs, `<placeholders>`, Rust paths, `VAR=value`, lists), does
///   not start with `/` or `~` (absolute paths are not the repository's) nor `./` (a program run
///   from some folder: `./run.sh` in the GPU bundle), does not name `target/` (build output), and
///   either
///   - contains a `/` and starts with `../`, ends with `/`, ends in a known extension
///     (`.rs`, `.md`, `.toml`, `.py`, `.json`, `.csv`, `.svg`, ...), or starts with the name of a
///     file or folder of the repository (so `cli/tests/data` is a path and the benchmark id
///     `latency/steppool_planned/256` is not), or
///   - is a bare file name with a source extension (`.rs`, `.md`, `.toml`, `.py`, `.txt`, `.ptx`,
///     `.lock`; a bare `out.jsonl` or `my_job.csv` names a file the user brings or writes).
///
///   It exists when a file or folder of the repository is that path or ends with it at a `/`, so
///   root-relative paths (`cli/tests/data`), paths relative to the document (`src/alloc.rs` in
///   benches/README.md) and the code map's names (`pool.rs`, `sim/`) all resolve; a trailing `/`
///   asks for a folder. A span with `..` is resolved against the document's folder only.
///
/// A path that leaves the repository is an error, and so is any path through `../shared`: a clean
/// clone has no folder beside it. The repository's files are those git tracks or would add
/// (untracked, not ignored) that are on disk.
#[test]
fn docs_name_only_paths_that_exist() {
    let tree = Tree::new(present_files());
    let problems: Vec<String> = DOCS.iter().flat_map(|doc| doc_problems(doc, &read(doc), &tree)).collect();
    assert!(
        problems.is_empty(),
        "the docs name {} path(s) that a clean clone does not have:\n  {}\n\
         (what counts as a path: the doc comment of `docs_name_only_paths_that_exist` in tests/tidy.rs)",
        problems.len(),
        problems.join("\n  ")
    );
}

#[test]
fn doc_paths_are_told_from_commands_identifiers_and_outputs() {
    let tree = Tree::new(
        ["README.md", "benches/README.md", "benches/src/alloc.rs", "benches/results/a.md", "cli/tests/data/x.csv"]
            .into_iter()
            .map(str::to_owned)
            .collect(),
    );
    let markdown = "\
Reads `cli/tests/data` and `cli/tests/data/`, `src/alloc.rs`, `alloc.rs`, [a](results/a.md#top).\n\
Not paths: `cargo test -p x`, `results/*`, `<date>.json`, `crate::x`, `STEPPOOL_DEVICE=sim`,\n\
`latency/steppool_planned/256`, `out.jsonl`, `/tmp/bundle`, `./run.sh`, `target/criterion/`, [w](https://x.org/a.md).\n\
```sh\n\
cargo run -- missing/file.rs\n\
```\n\
Missing: `cli/tests/gone.csv`, `gone.rs`, `benches/nothing/`, `alloc.rs/`, [b](results/b.md).\n\
Outside: `../shared/traces/`, [c](../../x.md), `../../y.rs`.\n";
    let verdicts: Vec<(String, Verdict)> = mentions(markdown)
        .into_iter()
        .map(|mention| {
            let verdict = check_mention(&mention, "benches", &tree);
            (mention.text, verdict)
        })
        .collect();
    let of = |verdict: Verdict| -> Vec<&str> {
        verdicts.iter().filter(|(_, v)| *v == verdict).map(|(text, _)| text.as_str()).collect()
    };
    assert_eq!(
        of(Verdict::Exists),
        ["cli/tests/data", "cli/tests/data/", "src/alloc.rs", "alloc.rs", "results/a.md#top"]
    );
    assert_eq!(
        of(Verdict::Missing),
        ["cli/tests/gone.csv", "gone.rs", "benches/nothing/", "alloc.rs/", "results/b.md"]
    );
    assert_eq!(of(Verdict::Outside), ["../shared/traces/", "../../x.md", "../../y.rs"]);
    assert!(!verdicts.iter().any(|(text, _)| text.contains("missing/file.rs")), "code blocks are not read");
    let problems = doc_problems("benches/README.md", markdown, &tree);
    assert_eq!(problems.len(), 8, "{problems:#?}");
    assert!(problems[0].starts_with("benches/README.md:7: `cli/tests/gone.csv`"), "{problems:#?}");
}

#[test]
fn code_spans_broken_across_lines_are_one_span() {
    let spans = mentions("runs `cargo run --example training_loop -- --trace\nt.jsonl` and `a/b.rs`\n");
    assert_eq!(spans.len(), 2);
    assert_eq!(spans[0].text, "cargo run --example training_loop -- --trace t.jsonl");
    assert_eq!((spans[1].text.as_str(), spans[1].line), ("a/b.rs", 2));
}

// ---------------------------------------------------------------------------------------------
// 3. ARCHITECTURE.md's code map

/// The source folders whose every `.rs` file the code map names.
const MAPPED_SOURCES: [&str; 4] = ["runtime/src/", "sys/src/", "cli/src/", "benches/src/"];

fn is_path_char(c: char) -> bool {
    c.is_alphanumeric() || matches!(c, '_' | '-' | '.' | '/')
}

/// Byte offsets of `needle` in `text` where it is not part of a longer path: the character before
/// is no path character, nor the one after (unless `open_end`, which lets a folder name run on into
/// a path below it).
fn occurrences(text: &str, needle: &str, open_end: bool) -> Vec<usize> {
    text.match_indices(needle)
        .map(|(at, _)| at)
        .filter(|&at| {
            let before = text[..at].chars().next_back();
            let after = text[at + needle.len()..].chars().next();
            !before.is_some_and(is_path_char)
                && (open_end || !after.is_some_and(|c| is_path_char(c) && !matches!(c, '.' | '-')))
        })
        .collect()
}

/// The files and crate folders of `files` that `architecture` does not name; the rule is
/// documented on [`architecture_names_every_module`].
fn unnamed_in_code_map(architecture: &str, files: &BTreeSet<String>) -> Vec<String> {
    let crates: Vec<&str> = files
        .iter()
        .filter_map(|file| file.strip_suffix("/Cargo.toml").filter(|folder| !folder.contains('/')))
        .collect();
    // Where each crate's section opens: its folder named alone, as `runtime/`.
    let mut openings: Vec<(usize, &str)> = crates
        .iter()
        .flat_map(|name| {
            let folder = format!("{name}/");
            occurrences(architecture, &folder, false).into_iter().map(move |at| (at, *name))
        })
        .collect();
    openings.sort_unstable();
    let section_at = |at: usize| openings.iter().take_while(|(start, _)| *start <= at).last().map(|(_, name)| *name);

    let mut unnamed = Vec::new();
    for name in &crates {
        if occurrences(architecture, &format!("{name}/"), true).is_empty() {
            unnamed.push(format!("{name}/ (the crate folder)"));
        }
    }
    for file in files.iter().filter(|file| MAPPED_SOURCES.iter().any(|source| file.starts_with(source))) {
        let Some(stem) = file.strip_suffix(".rs") else { continue };
        let components: Vec<&str> = stem.split('/').collect();
        let crate_name = components[0];
        if components.len() == 3 && matches!(components[2], "lib" | "main") {
            continue; // the crate root, named by its crate folder
        }
        let file_components: Vec<&str> = file.split('/').collect();
        // The names that count: the file name (a module folder for `mod.rs`) and every longer
        // suffix of the path.
        let mut names: Vec<String> = Vec::new();
        for start in (0..file_components.len()).rev() {
            let suffix = file_components[start..].join("/");
            if components.last() == Some(&"mod") {
                if start + 1 < file_components.len() {
                    let folder = file_components[start..file_components.len() - 1].join("/");
                    names.push(format!("{folder}/"));
                    names.push(suffix);
                }
            } else {
                names.push(suffix);
            }
        }
        let named = names.iter().any(|name| {
            occurrences(architecture, name, false)
                .into_iter()
                .any(|at| name.starts_with(&format!("{crate_name}/")) || section_at(at) == Some(crate_name))
        });
        if !named {
            let how = if components.last() == Some(&"mod") {
                format!("`{}` in the `{crate_name}/` part", names[0])
            } else {
                format!("`{}` in the `{crate_name}/` part, or `{file}`", names[0])
            };
            unnamed.push(format!("{file} (name it as {how})"));
        }
    }
    unnamed
}

/// ARCHITECTURE.md's code map names every module and crate.
///
/// Every `.rs` file under runtime/src, sys/src, cli/src and benches/src must be named, and every
/// crate folder (a top-level folder with a Cargo.toml) must appear as `name/`. A crate's root
/// (`src/lib.rs`, `src/main.rs`) is named by its crate folder.
///
/// The document is read as plain text, in sections: a crate folder written alone (`runtime/`,
/// not followed by more of a path) opens that crate's section, which runs to the next such
/// opening. A file is named when, in its crate's section, the text holds its file name (`pool.rs`)
/// or a longer suffix of its path (`src/bin/report.rs`), or anywhere holds its whole path from the
/// root (`sys/src/driver.rs`); a `dir/mod.rs` is named by its folder (`sim/`, `telemetry/`) the same
/// way. A name counts only where it is not part of a longer path: `report.rs` inside
/// `src/bin/report.rs` names `benches/src/bin/report.rs`, not `benches/src/report.rs`. Sections are
/// what tell apart the files of one name in several crates (`trace.rs`, `report.rs`, `error.rs`).
#[test]
fn architecture_names_every_module() {
    let unnamed = unnamed_in_code_map(&read("ARCHITECTURE.md"), &present_files());
    assert!(
        unnamed.is_empty(),
        "ARCHITECTURE.md's code map does not name {} module(s) or crate(s):\n  {}\n\
         Add each to the code map, in its crate's part (the rule: the doc comment of \
         `architecture_names_every_module` in tests/tidy.rs).",
        unnamed.len(),
        unnamed.join("\n  ")
    );
}

#[test]
fn the_code_map_rule_reads_sections_and_whole_names() {
    let files: BTreeSet<String> = [
        "runtime/Cargo.toml",
        "runtime/src/lib.rs",
        "runtime/src/pool.rs",
        "runtime/src/trace.rs",
        "runtime/src/strategy/mod.rs",
        "runtime/src/strategy/arena.rs",
        "cli/Cargo.toml",
        "cli/src/main.rs",
        "cli/src/trace.rs",
        "cli/src/read/mod.rs",
        "cli/src/read/rmm.rs",
        "benches/Cargo.toml",
        "benches/src/report.rs",
        "benches/src/bin/report.rs",
        "xtask/Cargo.toml",
        "xtask/src/main.rs",
    ]
    .into_iter()
    .map(str::to_owned)
    .collect();
    let architecture = "\
### `runtime/`\n- `pool.rs`, `trace.rs`, `strategy/` with `arena.rs`\n\
### `cli/`\n- `read/` (`read/rmm.rs`), and the runtime's `runtime/src/pool.rs`\n\
### `benches/`\n- the report tool, `src/bin/report.rs`\n";
    assert_eq!(
        unnamed_in_code_map(architecture, &files),
        [
            "xtask/ (the crate folder)",
            "benches/src/report.rs (name it as `report.rs` in the `benches/` part, or `benches/src/report.rs`)",
            "cli/src/trace.rs (name it as `trace.rs` in the `cli/` part, or `cli/src/trace.rs`)",
        ]
    );
}

// ---------------------------------------------------------------------------------------------
// 4. Compile-fail cases

const COMPILE_FAIL: &str = "runtime/borrowck/tests/compile_fail/";

/// The diagnostics of a rustc `.stderr`: each `error[E....]: ...` or `error: ...` header line, not
/// counting rustc's closing `error: aborting due to ...`. Each is `(code or "error", line)`.
fn diagnostics(stderr: &str) -> Vec<(String, usize)> {
    stderr
        .lines()
        .enumerate()
        .filter_map(|(index, line)| {
            if let Some(rest) = line.strip_prefix("error[") {
                let code = rest.split(']').next().unwrap_or_default();
                Some((code.to_owned(), index + 1))
            } else if line.starts_with("error:") && !line.starts_with("error: aborting due to") {
                Some(("error".to_owned(), index + 1))
            } else {
                None
            }
        })
        .collect()
}

/// The `// expect: E0505` comments of a case: the error each says the case fails with.
fn expectations(source: &str) -> Vec<String> {
    source
        .lines()
        .filter_map(|line| line.trim().strip_prefix("//")?.trim().strip_prefix("expect:"))
        .map(|rest| rest.split_whitespace().next().unwrap_or_default().to_owned())
        .collect()
}

/// The problems of one case `name` (its path without `.rs`), given its source and `.stderr`.
fn case_problems(name: &str, source: &str, stderr: &str) -> Vec<String> {
    let mut problems = Vec::new();
    let found = diagnostics(stderr);
    if found.len() != 1 {
        let listed: Vec<String> = found.iter().map(|(code, line)| format!("{code} at line {line}")).collect();
        problems.push(format!(
            "{name}.stderr holds {} diagnostics ({}); a case fails for exactly one reason: change the \
             case so that only the error it is about remains, and regenerate the .stderr \
             (TRYBUILD=overwrite cargo test -p steppool-borrowck --test compile_fail)",
            found.len(),
            if listed.is_empty() { "none".to_owned() } else { listed.join(", ") }
        ));
    }
    let expected = expectations(source);
    match expected.as_slice() {
        [] => problems.push(format!(
            "{name}.rs names no expected error: add `// expect: {}` (the code in its .stderr) at its end, \
             where it moves no line the .stderr quotes",
            found.first().map_or("E....", |(code, _)| code.as_str())
        )),
        [code] => {
            if let Some((actual, line)) = found.iter().find(|(actual, _)| actual != code) {
                problems.push(format!(
                    "{name}.rs expects {code}, but its .stderr has {actual} at line {line}: fix the case or \
                     its comment"
                ));
            }
        }
        several => problems.push(format!(
            "{name}.rs has {} `// expect:` comments ({}); keep the one that matches its .stderr",
            several.len(),
            several.join(", ")
        )),
    }
    problems
}

/// Each trybuild case in runtime/borrowck/tests/compile_fail fails with exactly one intended error: its
/// `.stderr` holds one diagnostic, and its `.rs` names that error's code in a `// expect: E0505`
/// comment (`// expect: error` for a diagnostic without a code).
#[test]
fn compile_fail_cases_fail_with_their_one_expected_error() {
    let files = present_files();
    let cases: BTreeSet<&str> = files
        .iter()
        .filter_map(|file| file.strip_prefix(COMPILE_FAIL))
        .filter(|name| !name.contains('/'))
        .filter_map(|name| name.strip_suffix(".rs").or_else(|| name.strip_suffix(".stderr")))
        .collect();
    assert!(!cases.is_empty(), "no compile-fail cases found in {COMPILE_FAIL}");
    let mut problems = Vec::new();
    for case in cases {
        let name = format!("{COMPILE_FAIL}{case}");
        let (rs, stderr) = (format!("{name}.rs"), format!("{name}.stderr"));
        match (files.contains(&rs), files.contains(&stderr)) {
            (true, true) => problems.extend(case_problems(&name, &read(&rs), &read(&stderr))),
            (true, false) => problems.push(format!(
                "{rs} has no .stderr: write it with TRYBUILD=overwrite cargo test -p steppool-borrowck --test compile_fail"
            )),
            (false, _) => problems.push(format!("{stderr} has no .rs case: delete it")),
        }
    }
    assert!(
        problems.is_empty(),
        "compile-fail cases that do not fail with one expected error:\n  {}",
        problems.join("\n  ")
    );
}

#[test]
fn compile_fail_rules_count_diagnostics_and_match_codes() {
    let one =
        "error[E0505]: cannot move out of `step`\n --> x.rs:8:5\n  |\n\nerror: aborting due to 1 previous error\n";
    let two = "error[E0505]: a\n\nerror[E0597]: b\n\nwarning: unused\nerror: aborting due to 2 previous errors\n";
    let codeless = "error: cannot find macro `x` in this scope\n";
    assert_eq!(diagnostics(one), [("E0505".to_owned(), 1)]);
    assert_eq!(diagnostics(two), [("E0505".to_owned(), 1), ("E0597".to_owned(), 3)]);
    assert_eq!(diagnostics(codeless), [("error".to_owned(), 1)]);

    assert!(case_problems("c", "fn main() {}\n// expect: E0505 (the step is borrowed)\n", one).is_empty());
    assert!(case_problems("c", "fn main() {}\n// expect: error\n", codeless).is_empty());
    let problems = case_problems("c", "fn main() {}\n", one);
    assert!(problems.len() == 1 && problems[0].contains("add `// expect: E0505`"), "{problems:?}");
    let problems = case_problems("c", "// expect: E0597\n", one);
    assert!(problems.len() == 1 && problems[0].contains("expects E0597, but its .stderr has E0505"), "{problems:?}");
    let problems = case_problems("c", "// expect: E0505\n", two);
    assert!(problems.len() == 2 && problems[0].contains("2 diagnostics (E0505 at line 1, E0597 at line 3)"));
    let problems = case_problems("c", "// expect: E0505\n// expect: E0505\n", one);
    assert!(problems.len() == 1 && problems[0].contains("2 `// expect:` comments"), "{problems:?}");
}

// ---------------------------------------------------------------------------------------------
// 5. The runtime's imports

/// One import arrow: module `from` uses something of module `to`, at `file:line`.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Import {
    from: String,
    to: String,
    file: String,
    line: usize,
}

/// The module a source file is, as path segments from the crate root: `lib.rs` is the root,
/// `a.rs` and `a/mod.rs` are `a`, `a/b.rs` is `a::b`.
fn module_of(file: &str) -> Option<Vec<String>> {
    let stem = file.strip_suffix(".rs")?;
    let mut segments: Vec<String> = stem.split('/').map(str::to_owned).collect();
    if segments == ["lib"] || segments == ["main"] {
        return Some(Vec::new());
    }
    if segments.len() > 1 && segments.last().is_some_and(|last| last == "mod") {
        segments.pop();
    }
    Some(segments)
}

fn module_name(segments: &[String]) -> String {
    if segments.is_empty() { "crate".to_owned() } else { segments.join("::") }
}

/// Collects the paths of one file that start with `crate`, `self` or `super`, resolved from the
/// crate root, with their lines.
struct PathCollector {
    /// The file's module.
    module: Vec<String>,
    /// Inline modules (`mod tests { ... }`) entered inside the file.
    inline: Vec<String>,
    found: Vec<(Vec<String>, usize)>,
}

impl PathCollector {
    fn record(&mut self, segments: &[String], line: usize) {
        let mut base: Vec<String> = self.module.iter().chain(&self.inline).cloned().collect();
        let rest = match segments.first().map(String::as_str) {
            Some("crate") => {
                base.clear();
                &segments[1..]
            }
            Some("self") => &segments[1..],
            Some("super") => {
                let mut rest = segments;
                while rest.first().is_some_and(|s| s == "super") {
                    if base.pop().is_none() {
                        return; // above the crate root: not this crate's module
                    }
                    rest = &rest[1..];
                }
                rest
            }
            _ => return, // another crate, or a name in scope (its import was recorded where it was made)
        };
        base.extend(rest.iter().cloned());
        self.found.push((base, line));
    }

    /// `crate::a::b` paths inside macro bodies, which syn leaves as tokens.
    fn scan_tokens(&mut self, tokens: TokenStream) {
        let trees: Vec<TokenTree> = tokens.into_iter().collect();
        let mut at = 0;
        while at < trees.len() {
            match &trees[at] {
                TokenTree::Group(group) => self.scan_tokens(group.stream()),
                TokenTree::Ident(ident) if ident == "crate" => {
                    let mut segments = vec!["crate".to_owned()];
                    let mut next = at + 1;
                    while let (
                        Some(TokenTree::Punct(first)),
                        Some(TokenTree::Punct(second)),
                        Some(TokenTree::Ident(name)),
                    ) = (trees.get(next), trees.get(next + 1), trees.get(next + 2))
                    {
                        if first.as_char() != ':' || second.as_char() != ':' {
                            break;
                        }
                        segments.push(name.to_string());
                        next += 3;
                    }
                    if segments.len() > 1 {
                        self.record(&segments, ident.span().start().line);
                    }
                    at = next;
                    continue;
                }
                _ => {}
            }
            at += 1;
        }
    }
}

/// The paths a `use` tree brings in: `use crate::{a, b::{self, C}}` gives `crate::a`, `crate::b`
/// and `crate::b::C`, each with the line of its last name.
fn use_paths(tree: &syn::UseTree, prefix: &mut Vec<String>, out: &mut Vec<(Vec<String>, usize)>) {
    let mut leaf = |ident: &syn::Ident, prefix: &[String]| {
        let mut path = prefix.to_vec();
        if ident != "self" {
            path.push(ident.to_string());
        }
        out.push((path, ident.span().start().line));
    };
    match tree {
        syn::UseTree::Path(path) => {
            prefix.push(path.ident.to_string());
            use_paths(&path.tree, prefix, out);
            prefix.pop();
        }
        syn::UseTree::Name(name) => leaf(&name.ident, prefix),
        syn::UseTree::Rename(rename) => leaf(&rename.ident, prefix),
        syn::UseTree::Glob(glob) => out.push((prefix.clone(), glob.star_token.spans[0].start().line)),
        syn::UseTree::Group(group) => {
            for item in &group.items {
                use_paths(item, prefix, out);
            }
        }
    }
}

impl<'ast> Visit<'ast> for PathCollector {
    fn visit_item_mod(&mut self, item: &'ast syn::ItemMod) {
        // `mod x;` declares a child file, read on its own; an inline module is part of this file.
        if item.content.is_some() {
            self.inline.push(item.ident.to_string());
            visit::visit_item_mod(self, item);
            self.inline.pop();
        }
    }

    fn visit_item_use(&mut self, item: &'ast syn::ItemUse) {
        let mut paths = Vec::new();
        use_paths(&item.tree, &mut Vec::new(), &mut paths);
        for (path, line) in paths {
            self.record(&path, line);
        }
    }

    fn visit_path(&mut self, path: &'ast syn::Path) {
        if path.leading_colon.is_none() {
            let segments: Vec<String> = path.segments.iter().map(|segment| segment.ident.to_string()).collect();
            if let Some(first) = path.segments.first() {
                self.record(&segments, first.ident.span().start().line);
            }
        }
        visit::visit_path(self, path);
    }

    /// `pub(crate)`, `pub(super)`: who may see an item, not what it uses.
    fn visit_visibility(&mut self, _: &'ast syn::Visibility) {}

    fn visit_macro(&mut self, mac: &'ast syn::Macro) {
        self.visit_path(&mac.path);
        self.scan_tokens(mac.tokens.clone());
    }
}

/// The import arrows among the modules of one crate, from its source files given as (path relative
/// to the crate's `src/`, text). A path names the longest module with a file that it starts with
/// (`crate::a::b::C` is `a::b` when `a/b.rs` or `a/b/mod.rs` exists, else `a`). Arrows from a module
/// to itself or to its own submodules are left out; from a submodule up to its parent they count.
fn imports(files: &[(String, String)]) -> Result<Vec<Import>, String> {
    let modules: BTreeSet<Vec<String>> = files.iter().filter_map(|(path, _)| module_of(path)).collect();
    let mut arrows = Vec::new();
    for (path, text) in files {
        let Some(module) = module_of(path) else { continue };
        let syntax = syn::parse_file(text).map_err(|error| {
            let start = error.span().start();
            format!("{path}:{}:{}: cannot parse: {error}", start.line, start.column + 1)
        })?;
        let mut collector = PathCollector { module: module.clone(), inline: Vec::new(), found: Vec::new() };
        collector.visit_file(&syntax);
        for (segments, line) in collector.found {
            let length = (0..=segments.len()).rev().find(|&n| modules.contains(&segments[..n])).unwrap_or(0);
            let target = &segments[..length];
            if target.starts_with(&module) {
                continue; // itself, or one of its own submodules
            }
            arrows.push(Import { from: module_name(&module), to: module_name(target), file: path.clone(), line });
        }
    }
    Ok(arrows)
}

/// The strongly connected components of more than one module (Tarjan), each sorted.
fn cycles(graph: &BTreeMap<&str, BTreeSet<&str>>) -> Vec<Vec<String>> {
    struct Tarjan<'a> {
        graph: &'a BTreeMap<&'a str, BTreeSet<&'a str>>,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on_stack: BTreeSet<&'a str>,
        components: Vec<Vec<String>>,
    }
    impl<'a> Tarjan<'a> {
        fn visit(&mut self, node: &'a str) {
            let number = self.index.len();
            self.index.insert(node, number);
            self.low.insert(node, number);
            self.stack.push(node);
            self.on_stack.insert(node);
            for &next in self.graph.get(node).into_iter().flatten() {
                if !self.index.contains_key(next) {
                    self.visit(next);
                    let low = self.low[node].min(self.low[next]);
                    self.low.insert(node, low);
                } else if self.on_stack.contains(next) {
                    let low = self.low[node].min(self.index[next]);
                    self.low.insert(node, low);
                }
            }
            if self.low[node] == self.index[node] {
                let mut component = Vec::new();
                while let Some(member) = self.stack.pop() {
                    self.on_stack.remove(member);
                    component.push(member.to_owned());
                    if member == node {
                        break;
                    }
                }
                if component.len() > 1 {
                    component.sort();
                    self.components.push(component);
                }
            }
        }
    }
    let mut tarjan = Tarjan {
        graph,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        components: Vec::new(),
    };
    for &node in graph.keys() {
        if !tarjan.index.contains_key(node) {
            tarjan.visit(node);
        }
    }
    tarjan.components.sort();
    tarjan.components
}

/// The shortest cycle through `start` inside `members`, as the modules in order (breadth-first).
fn shortest_cycle(graph: &BTreeMap<&str, BTreeSet<&str>>, members: &BTreeSet<&str>, start: &str) -> Vec<String> {
    let mut came_from: BTreeMap<&str, &str> = BTreeMap::new();
    let mut queue = VecDeque::from([start]);
    while let Some(node) = queue.pop_front() {
        for &next in graph.get(node).into_iter().flatten().filter(|next| members.contains(*next)) {
            if next == start {
                let mut path = vec![node.to_owned()];
                let mut at = node;
                while at != start {
                    at = came_from[at];
                    path.push(at.to_owned());
                }
                path.reverse();
                return path;
            }
            if !came_from.contains_key(next) {
                came_from.insert(next, node);
                queue.push_back(next);
            }
        }
    }
    vec![start.to_owned()]
}

/// A report of the import cycles among `imports`, whose files are shown under `src` (the crate's
/// source folder); `None` when the imports go one way.
fn cycle_report(imports: &[Import], src: &str) -> Option<String> {
    let mut graph: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
    let mut sites: BTreeMap<(&str, &str), Vec<(&str, usize)>> = BTreeMap::new();
    for import in imports {
        graph.entry(&import.from).or_default().insert(&import.to);
        sites.entry((&import.from, &import.to)).or_default().push((&import.file, import.line));
    }
    let components = cycles(&graph);
    if components.is_empty() {
        return None;
    }
    let mut report = format!(
        "the runtime's modules import one another in {} cycle(s); they must go one way, so that each \
         module can be read, tested and changed with only the ones below it.\n",
        components.len()
    );
    for component in &components {
        let members: BTreeSet<&str> = component.iter().map(String::as_str).collect();
        let _ = writeln!(report, "\n{} modules in one cycle: {}", component.len(), component.join(", "));
        let mut shown: BTreeSet<Vec<String>> = BTreeSet::new();
        let mut found: Vec<Vec<String>> = Vec::new();
        for member in &members {
            let cycle = shortest_cycle(&graph, &members, member);
            let smallest = (0..cycle.len()).min_by_key(|&i| &cycle[i]).unwrap_or(0);
            let mut canonical = cycle.clone();
            canonical.rotate_left(smallest);
            if shown.insert(canonical.clone()) {
                found.push(canonical);
            }
        }
        found.sort_by_key(|cycle| (cycle.len(), cycle.clone()));
        for cycle in &found {
            let _ = writeln!(report, "  {} -> {}", cycle.join(" -> "), cycle[0]);
        }
        let _ = writeln!(report, "  the imports among them:");
        for ((from, to), at) in sites.iter().filter(|((from, to), _)| members.contains(from) && members.contains(to)) {
            let mut places: Vec<String> = Vec::new();
            for (file, line) in at {
                let place = format!("{src}{file}:{line}");
                if !places.contains(&place) {
                    places.push(place);
                }
            }
            let shown_places = places.iter().take(3).cloned().collect::<Vec<_>>().join(", ");
            let more = if places.len() > 3 { format!(" and {} more", places.len() - 3) } else { String::new() };
            let _ = writeln!(report, "    {from} -> {to}: {shown_places}{more}");
        }
    }
    report.push_str(
        "\nBreak each cycle: move what a lower module takes from a higher one down into it (or into a \
         module below both), or pass it in.\n",
    );
    Some(report)
}

/// The runtime crate's modules import one another one way: there is no cycle among them.
///
/// A module is a file (`a/mod.rs` is `a`, `a/b.rs` is `a::b`, `lib.rs` is `crate`). Its imports
/// are its `use crate::...`, `use super::...` and `use self::...` items (grouped and spread over
/// lines included, in inline modules such as `mod tests` too) and the `crate::`, `super::` and
/// `self::` paths written in its code and types, and `crate::` paths inside macro calls. Each names
/// the longest module with a file it starts with: `crate::a::b::C` is `a::b` if that file exists,
/// else `a`. A module's own submodules are not arrows (`strategy` declares `mod arena;` and may use
/// it); a submodule's import of its parent is. `pub(crate)` and `pub(super)` are no imports.
/// Re-exports are not followed: `crate::telemetry::MetricsServer`, which `telemetry/mod.rs`
/// re-exports from `telemetry/http.rs`, points to `telemetry`.
///
/// Rust is parsed with `syn` (a line scanner would miss `use` trees spread over lines and paths in
/// code, and take `crate::` in strings and comments for imports); `crate::` paths inside macro
/// calls, which syn leaves as tokens, are read from the tokens.
#[test]
fn runtime_imports_have_no_cycle() {
    let src = "runtime/src/";
    let files: Vec<(String, String)> = present_files()
        .into_iter()
        .filter(|file| file.starts_with(src) && file.ends_with(".rs"))
        .map(|file| (file[src.len()..].to_owned(), read(&file)))
        .collect();
    assert!(!files.is_empty(), "no Rust files under {src}");
    let imports = imports(&files).unwrap_or_else(|error| panic!("{src}{error}"));
    if let Some(report) = cycle_report(&imports, src) {
        panic!("{report}");
    }
}

fn sources(files: &[(&str, &str)]) -> Vec<(String, String)> {
    files.iter().map(|(path, text)| ((*path).to_owned(), (*text).to_owned())).collect()
}

fn arrows(imports: &[Import]) -> Vec<(String, String, usize)> {
    imports.iter().map(|i| (i.from.clone(), i.to.clone(), i.line)).collect()
}

#[test]
fn an_import_cycle_is_found_and_printed() {
    let files = sources(&[
        ("lib.rs", "mod pool;\nmod runtime;\nmod step;\npub use runtime::Runtime;\n"),
        ("pool.rs", "use crate::runtime::RuntimeInner;\npub struct PhasePool;\n"),
        ("runtime.rs", "use crate::pool::PhasePool;\npub struct Runtime;\npub struct RuntimeInner;\n"),
        ("step.rs", "use crate::runtime::Runtime;\n"),
    ]);
    let imports = imports(&files).unwrap();
    let report = cycle_report(&imports, "runtime/src/").expect("pool and runtime import each other");
    assert!(report.contains("2 modules in one cycle: pool, runtime"), "{report}");
    assert!(report.contains("  pool -> runtime -> pool\n"), "{report}");
    assert!(report.contains("pool -> runtime: runtime/src/pool.rs:1"), "{report}");
    assert!(report.contains("runtime -> pool: runtime/src/runtime.rs:1"), "{report}");
    assert!(!report.contains("step"), "step is outside the cycle: {report}");
}

#[test]
fn a_longer_cycle_is_printed_in_order() {
    let files = sources(&[
        ("lib.rs", "mod a; mod b; mod c;"),
        ("a.rs", "use crate::b::B;"),
        ("b.rs", "pub struct B; fn f() -> crate::c::C { todo!() }"),
        ("c.rs", "pub struct C; fn g() { let _ = crate::a::A; }"),
    ]);
    let report = cycle_report(&imports(&files).unwrap(), "").expect("a -> b -> c -> a");
    assert!(report.contains("  a -> b -> c -> a\n"), "{report}");
}

#[test]
fn imports_that_go_one_way_pass() {
    let files = sources(&[
        ("lib.rs", "mod error;\nmod pool;\nmod strategy;\npub use strategy::Strategy;\npub use crate::error::Error;\n"),
        (
            "error.rs",
            "pub struct Error;\n#[cfg(test)]\nmod tests {\n    use super::*;\n    use super::super::Error as E;\n}\n",
        ),
        ("pool.rs", "use crate::strategy::{Allocator, arena::Arena};\nuse crate::error::Error;\n"),
        (
            "strategy/mod.rs",
            "mod arena;\npub use self::arena::Arena;\nuse arena::Slab;\nuse crate::error::Error;\n\
             pub(crate) struct Source;\npub(super) fn f() {}\n",
        ),
        ("strategy/arena.rs", "use super::Source;\nuse crate::strategy::Allocator;\nuse crate::error::Error;\n"),
    ]);
    let imports = imports(&files).unwrap();
    assert_eq!(cycle_report(&imports, ""), None, "{imports:#?}");
    let arrows = arrows(&imports);
    // A submodule's import of its parent is an arrow; the parent's use of its submodule is not.
    assert!(arrows.contains(&("strategy::arena".to_owned(), "strategy".to_owned(), 1)), "{arrows:?}");
    assert!(!arrows.iter().any(|(from, to, _)| from == "strategy" && to.starts_with("strategy::")), "{arrows:?}");
    assert!(arrows.contains(&("pool".to_owned(), "strategy::arena".to_owned(), 1)), "{arrows:?}");
    // A use of the root's re-export points to the root; `pub(crate)` and `pub(super)` point nowhere.
    assert!(arrows.contains(&("error".to_owned(), "crate".to_owned(), 5)), "{arrows:?}");
    assert!(!arrows.iter().any(|(from, _, _)| from == "crate"), "{arrows:?}");
    assert!(!arrows.iter().any(|(from, to, _)| from == "strategy" && to == "crate"), "{arrows:?}");
}

#[test]
fn grouped_multi_line_and_inline_paths_are_read() {
    let files = sources(&[
        ("lib.rs", "mod a; mod b; mod c; mod d; mod e;"),
        (
            "a.rs",
            "use crate::{\n    b::B,\n    c::{self, d::D},\n};\n\
             // use crate::e::Commented;\n\
             const S: &str = \"crate::e::InAString\";\n\
             fn f() -> usize { format!(\"{}\", crate::e::NAME).len() }\n\
             fn g(_: Vec<crate::b::Other>) {}\n",
        ),
        ("b.rs", ""),
        ("c/mod.rs", "mod d;"),
        ("c/d.rs", ""),
        ("d.rs", ""),
        ("e.rs", ""),
    ]);
    let imports = imports(&files).unwrap();
    let arrows = arrows(&imports);
    assert_eq!(
        arrows,
        [
            ("a".to_owned(), "b".to_owned(), 2),
            ("a".to_owned(), "c".to_owned(), 3),
            ("a".to_owned(), "c::d".to_owned(), 3),
            ("a".to_owned(), "e".to_owned(), 7),
            ("a".to_owned(), "b".to_owned(), 8),
        ]
    );
    assert!(imports.iter().all(|import| import.file == "a.rs"));
}

#[test]
fn a_path_names_the_deepest_module_with_a_file() {
    let files = sources(&[
        ("lib.rs", "mod telemetry; mod pool;"),
        ("telemetry/mod.rs", "mod metrics; pub struct Warning;"),
        ("telemetry/metrics.rs", ""),
        (
            "pool.rs",
            "use crate::telemetry::metrics::Usage;\nuse crate::telemetry::Warning;\nuse crate::telemetry::json::Lines;\n",
        ),
    ]);
    let arrows = arrows(&imports(&files).unwrap());
    assert_eq!(
        arrows,
        [
            ("pool".to_owned(), "telemetry::metrics".to_owned(), 1),
            ("pool".to_owned(), "telemetry".to_owned(), 2),
            ("pool".to_owned(), "telemetry".to_owned(), 3),
        ]
    );
}

#[test]
fn a_file_that_does_not_parse_is_an_error_naming_it() {
    let error = imports(&sources(&[("lib.rs", "mod a;"), ("a.rs", "fn f( {")])).unwrap_err();
    assert!(error.starts_with("a.rs:1:"), "{error}");
}
