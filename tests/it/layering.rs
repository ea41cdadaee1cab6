//! The layering `ARCHITECTURE.md` names, checked on the source: rules know nothing of stores,
//! headers, responses or metrics; alerts know nothing of the metrics facade; stores know nothing
//! of HTTP; no two top-level modules import each other, directly or around a circle; and no
//! file imports itself around a circle either, nested modules included (a module may use its
//! own submodules, and they it: that is nesting, not a circle).
//!
//! A module's imports are the `crate::<module>` (and `super::`) paths in its files, outside
//! comments and its `#[cfg(test)] mod tests` (tests may reach anywhere).

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

/// Top-level module name → the top-level modules it names.
type Graph = BTreeMap<String, BTreeSet<String>>;

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in fs::read_dir(dir).expect("src/ is readable") {
        let path = entry.expect("a directory entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|ext| ext == "rs") {
            out.push(path);
        }
    }
}

/// The code of a file without its comments and its unit-test module.
fn code_of(text: &str) -> String {
    let text = match text.find("#[cfg(test)]\nmod tests {") {
        Some(at) => &text[..at],
        None => text,
    };
    text.lines()
        .map(|line| match line.find("//") {
            Some(at) => &line[..at],
            None => line,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The identifier at the start of `text`.
fn leading_ident(text: &str) -> &str {
    let end = text
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .unwrap_or(text.len());
    &text[..end]
}

/// The items of a `{a, b::c, D}` group at the start of `text`: their first identifiers.
fn group_heads(text: &str) -> Vec<&str> {
    let mut heads = Vec::new();
    let (mut depth, mut item_start) = (0usize, 1usize);
    for (at, c) in text.char_indices() {
        match c {
            '{' => {
                depth += 1;
                if depth == 1 {
                    item_start = at + 1;
                }
            }
            '}' | ',' if depth == 1 => {
                heads.push(leading_ident(text[item_start..at].trim_start()));
                item_start = at + 1;
                if c == '}' {
                    break;
                }
            }
            '}' => depth -= 1,
            _ => {}
        }
    }
    heads.into_iter().filter(|head| !head.is_empty()).collect()
}

/// The top-level modules `code` names through `crate::`: `crate::policy::Rule`, each head of
/// `crate::{policy, store::Store}`, and a root re-export such as `crate::Store` through `roots`
/// (the module the crate root re-exports it from).
fn named_modules(code: &str, roots: &BTreeMap<String, String>) -> BTreeSet<String> {
    let mut named = BTreeSet::new();
    for (at, prefix) in code.match_indices("crate::") {
        let rest = &code[at + prefix.len()..];
        let heads = if rest.starts_with('{') {
            group_heads(rest)
        } else {
            vec![leading_ident(rest)]
        };
        for head in heads {
            if head.starts_with(|c: char| c.is_ascii_lowercase()) {
                named.insert(head.to_owned());
            } else if let Some(module) = roots.get(head) {
                named.insert(module.clone());
            }
        }
    }
    named
}

/// The names the crate root re-exports (`pub use store::{Store, StoreError}`), with the module
/// each comes from.
fn root_reexports(lib: &str) -> BTreeMap<String, String> {
    let mut roots = BTreeMap::new();
    let code = code_of(lib);
    for (at, prefix) in code.match_indices("pub use ") {
        let rest = &code[at + prefix.len()..];
        let module = leading_ident(rest);
        let path = &rest[..rest.find(';').unwrap_or(rest.len())];
        let names = match path.find('{') {
            Some(open) => group_heads(&path[open..]),
            None => vec![path.rsplit("::").next().unwrap_or("").trim()],
        };
        for name in names {
            if name.starts_with(|c: char| c.is_ascii_uppercase()) {
                roots.insert(name.to_owned(), module.to_owned());
            }
        }
    }
    roots
}

fn graph() -> Graph {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let roots = root_reexports(&fs::read_to_string(src.join("lib.rs")).expect("src/lib.rs"));
    let mut graph = Graph::new();
    for file in files {
        let relative = file.strip_prefix(&src).expect("under src/");
        let first = relative
            .components()
            .next()
            .expect("a path")
            .as_os_str()
            .to_string_lossy();
        let module = first.trim_end_matches(".rs").to_owned();
        if module == "lib" || relative.file_name().is_some_and(|name| name == "tests.rs") {
            continue;
        }
        let text = fs::read_to_string(&file).expect("a source file");
        let code = code_of(&text);
        let imports = graph.entry(module.clone()).or_default();
        imports.extend(
            named_modules(&code, &roots)
                .into_iter()
                .filter(|name| *name != module),
        );
        // The metrics facade is a crate, not a module: count it as the `metrics` node.
        if code.contains("metrics::") {
            imports.insert("metrics".to_owned());
        }
    }
    graph
}

/// Every module `from` reaches through its imports.
fn reachable(graph: &Graph, from: &str) -> BTreeSet<String> {
    let mut seen = BTreeSet::new();
    let mut stack = vec![from.to_owned()];
    while let Some(module) = stack.pop() {
        for next in graph.get(&module).into_iter().flatten() {
            if seen.insert(next.clone()) {
                stack.push(next.clone());
            }
        }
    }
    seen
}

#[test]
fn the_source_is_read_as_modules_with_imports() {
    let graph = graph();
    // The reading itself works: these imports exist and must be found.
    assert!(graph["limiter"].contains("policy"), "{graph:#?}");
    assert!(graph["response"].contains("headers"), "{graph:#?}");
    assert!(graph["limiter"].contains("metrics"), "{graph:#?}");
    assert!(graph.len() > 15, "{graph:#?}");
    // Grouped imports and root re-exports are read too.
    let roots = BTreeMap::from([("Store".to_owned(), "store".to_owned())]);
    let named = named_modules(
        "use crate::{headers::RATELIMIT, response::{self, TooManyRequests}, Store};",
        &roots,
    );
    assert_eq!(
        named,
        BTreeSet::from(["headers".into(), "response".into(), "store".into()])
    );
    let roots = root_reexports("pub use store::{MemoryStore, Store};\npub use limiter::Limiter;");
    assert_eq!(roots["Store"], "store");
    assert_eq!(roots["Limiter"], "limiter");
}

#[test]
fn no_module_imports_itself_around_a_circle() {
    let graph = graph();
    let circles: Vec<&String> = graph
        .keys()
        .filter(|module| reachable(&graph, module).contains(*module))
        .collect();
    assert!(
        circles.is_empty(),
        "modules on an import circle: {circles:?}\n{graph:#?}"
    );
}

#[test]
fn rules_keys_and_decisions_know_nothing_of_stores_headers_responses_or_metrics() {
    let graph = graph();
    let wire_and_beyond = [
        "store", "headers", "response", "metrics", "limiter", "layer", "grpc", "outbound", "config",
    ];
    for module in ["policy", "key", "decision", "client_ip", "alert"] {
        let reached = reachable(&graph, module);
        let wrong: Vec<_> = wire_and_beyond
            .iter()
            .filter(|name| reached.contains(**name))
            .collect();
        assert!(wrong.is_empty(), "{module} reaches {wrong:?}: {reached:?}");
    }
}

#[test]
fn alerts_report_without_the_metrics_facade() {
    let reached = reachable(&graph(), "alert");
    assert!(
        !reached.contains("limiter") && !reached.contains("metrics"),
        "alert reaches {reached:?}"
    );
}

#[test]
fn stores_know_nothing_of_http() {
    let reached = reachable(&graph(), "store");
    for http_side in ["layer", "limiter", "headers", "response", "grpc"] {
        assert!(
            !reached.contains(http_side),
            "store reaches {http_side}: {reached:?}"
        );
    }
}

/// Module path (`limiter::flow`, `limiter` for `limiter/mod.rs`, `store::redis::cluster`) → the
/// modules of the crate its code names, each as the longest module path that names it.
fn file_graph() -> Graph {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let module_of = |file: &Path| {
        let relative = file
            .strip_prefix(&src)
            .expect("under src/")
            .with_extension("");
        let mut parts: Vec<String> = relative
            .components()
            .map(|part| part.as_os_str().to_string_lossy().into_owned())
            .collect();
        if parts
            .last()
            .is_some_and(|last| last == "mod" || last == "lib")
        {
            parts.pop();
        }
        parts.join("::")
    };
    let modules: BTreeSet<String> = files.iter().map(|file| module_of(file)).collect();
    let mut graph = Graph::new();
    for file in &files {
        let module = module_of(file);
        if module.ends_with("tests") || module.is_empty() {
            continue;
        }
        let code = code_of(&fs::read_to_string(file).expect("a source file"));
        let parent = module.rsplit_once("::").map_or("", |(parent, _)| parent);
        let mut named = BTreeSet::new();
        for (anchor, base) in [("crate::", String::new()), ("super::", parent.to_owned())] {
            for (at, prefix) in code.match_indices(anchor) {
                // `super::super::` is read from its last `super::`, as the one before it.
                if anchor == "super::" && code[..at].ends_with("super::") {
                    continue;
                }
                for path in paths_at(&code[at + prefix.len()..]) {
                    let full = if base.is_empty() {
                        path
                    } else {
                        format!("{base}::{path}")
                    };
                    named.insert(longest_module(&modules, &full));
                }
            }
        }
        // Nesting is not importing: a module's own submodules are its parts.
        named.retain(|target| {
            !target.is_empty() && *target != module && !target.starts_with(&format!("{module}::"))
        });
        graph.entry(module).or_default().extend(named);
    }
    graph
}

/// The paths at the start of `text` (after `crate::` or `super::`): `a::b::C`, or each of a
/// group `{a, b::{c, D}}`, as far as they are module-like (`a::b`).
fn paths_at(text: &str) -> Vec<String> {
    let mut paths = Vec::new();
    let ident_path = |text: &str| -> String {
        let end = text
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
            .unwrap_or(text.len());
        text[..end].trim_end_matches(':').to_owned()
    };
    if let Some(group) = text.strip_prefix('{') {
        let (mut depth, mut start) = (0usize, 0usize);
        for (at, c) in group.char_indices() {
            match c {
                '{' => depth += 1,
                '}' if depth == 0 => {
                    paths.push(ident_path(group[start..at].trim_start()));
                    break;
                }
                '}' => depth -= 1,
                ',' if depth == 0 => {
                    paths.push(ident_path(group[start..at].trim_start()));
                    start = at + 1;
                }
                _ => {}
            }
        }
    } else {
        paths.push(ident_path(text));
    }
    paths.into_iter().filter(|path| !path.is_empty()).collect()
}

/// The longest of `modules` that `path` starts with (`limiter::slots` for
/// `limiter::slots::Lease`); the root (`""`) when none does.
fn longest_module(modules: &BTreeSet<String>, path: &str) -> String {
    let mut parts: Vec<&str> = path.split("::").collect();
    while !parts.is_empty() {
        let candidate = parts.join("::");
        if modules.contains(&candidate) {
            return candidate;
        }
        parts.pop();
    }
    String::new()
}

#[test]
fn nested_modules_are_read_file_by_file() {
    let graph = file_graph();
    // Real imports between nested modules are found...
    assert!(graph["limiter::flow"].contains("limiter"), "{graph:#?}");
    assert!(
        graph["limiter::charge"].contains("store::gcra"),
        "{graph:#?}"
    );
    assert!(graph["store::redis::batch"].contains("store"), "{graph:#?}");
    // ...and a parent's use of its own submodules is nesting, not an import.
    assert!(!graph["limiter"].contains("limiter::flow"), "{graph:#?}");
    let modules = BTreeSet::from(["limiter".to_owned(), "limiter::slots".to_owned()]);
    assert_eq!(
        longest_module(&modules, "limiter::slots::Lease"),
        "limiter::slots"
    );
    assert_eq!(longest_module(&modules, "limiter::Limiter"), "limiter");
    assert_eq!(
        paths_at("{Admission, slots::{Lease, SlotQueues}, flow};"),
        ["Admission", "slots::", "flow"].map(|path| path.trim_end_matches(':').to_owned())
    );
}

#[test]
fn no_file_imports_itself_around_a_circle() {
    let graph = file_graph();
    let circles: Vec<&String> = graph
        .keys()
        .filter(|module| reachable(&graph, module).contains(*module))
        .collect();
    assert!(
        circles.is_empty(),
        "files on an import circle: {circles:?}\n{graph:#?}"
    );
}

/// ARCHITECTURE.md is what a contributor reads first: it names every module folder of `src/`.
#[test]
fn the_architecture_names_every_module_folder() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let architecture = fs::read_to_string(root.join("ARCHITECTURE.md")).expect("ARCHITECTURE.md");
    let mut folders = vec![root.join("src")];
    let mut unnamed = Vec::new();
    while let Some(folder) = folders.pop() {
        for entry in fs::read_dir(&folder).expect("a folder of src/") {
            let path = entry.expect("a directory entry").path();
            if path.is_dir() {
                let name = path.strip_prefix(root).expect("under the crate");
                let name = format!("`{}/`", name.display());
                if !architecture.contains(&name) {
                    unnamed.push(name);
                }
                folders.push(path);
            }
        }
    }
    assert!(
        unnamed.is_empty(),
        "ARCHITECTURE.md doesn't name {unnamed:?}"
    );
}

/// Lines of code of a file: neither blank nor a comment, outside its unit tests.
fn lines_of_code(text: &str) -> usize {
    code_of(text)
        .lines()
        .filter(|line| !line.trim().is_empty())
        .count()
}

/// A file past 600 lines of code is doing more than one job; the doors (the layer's service and
/// future, the extractor, the handle) only start the limiter's flow and turn its outcome into
/// their answer: 500 lines together, and no step of the flow they could reach by mistake.
#[test]
fn files_stay_small_and_the_doors_only_start_the_flow() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    rust_files(&root.join("src"), &mut files);
    let long: Vec<String> = files
        .iter()
        .filter(|file| !file.ends_with("tests.rs"))
        .map(|file| {
            (
                file,
                lines_of_code(&fs::read_to_string(file).expect("a source file")),
            )
        })
        .filter(|(_, lines)| *lines > 600)
        .map(|(file, lines)| format!("{} ({lines})", file.display()))
        .collect();
    assert!(long.is_empty(), "past 600 lines of code: {long:?}");
    let doors = [
        "src/layer/service.rs",
        "src/layer/future.rs",
        "src/extract.rs",
        "src/rate_limiter.rs",
    ];
    let mut total = 0;
    for door in doors {
        let code = code_of(&fs::read_to_string(root.join(door)).expect("a door"));
        assert!(
            !code.contains("unreachable!"),
            "{door} has an unreachable! arm"
        );
        total += lines_of_code(&code);
    }
    assert!(total <= 500, "the doors hold {total} lines of code");
    // The counting itself: comments, blank lines and unit tests are not code.
    let sample = "/// doc\nfn a() {}\n\n// note\nfn b() {} // why\n#[cfg(test)]\nmod tests {\nfn c() {}\n}\n";
    assert_eq!(lines_of_code(sample), 2);
}

/// Every door starts the limiter's flow and none calls a store itself: the layer, the extractor,
/// the handle, gRPC's answers, a config file's routes and the outbound layer (its tower service
/// and its reqwest middleware), whose waiting for a slot, a pause or room, and whose answer to a
/// store failure, are the flow's (`src/limiter/outgoing.rs`).
#[test]
fn no_door_calls_a_store_itself() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut doors = vec![
        root.join("src/extract.rs"),
        root.join("src/rate_limiter.rs"),
        root.join("src/grpc.rs"),
        root.join("src/config/layer.rs"),
    ];
    rust_files(&root.join("src/layer"), &mut doors);
    rust_files(&root.join("src/outbound"), &mut doors);
    // A store's calls, on a store held or borrowed (`store.check(`, `store().give_back(`).
    let calls = [
        "check",
        "peek",
        "refund",
        "give_back",
        "overdraw",
        "release",
        "release_then",
        "reset",
        "pause",
        "pause_left",
    ];
    let mut found = Vec::new();
    for door in &doors {
        let code = code_of(&fs::read_to_string(door).expect("a door"));
        for call in calls {
            for receiver in ["store.", "store()."] {
                if code.contains(&format!("{receiver}{call}(")) {
                    let path = door.strip_prefix(root).expect("under the crate");
                    found.push(format!("{}: {receiver}{call}(", path.display()));
                }
            }
        }
    }
    assert!(found.is_empty(), "doors that call a store: {found:?}");
    // The search itself finds such a call.
    let sample = code_of("let answer = self.store.check(&request).await; // store.pause(\n");
    assert!(sample.contains("store.check("));
    assert!(!sample.contains("store.pause("));
    assert!(doors.len() >= 10, "the doors read: {doors:?}");
}

/// The limiter hands each request to parts that own their state (the prefetch table, the slots
/// and their queues, the refusal cache, the telemetry, the settling), rather than doing all of it
/// itself: `impl Limiter` stays in the four files ARCHITECTURE.md names.
#[test]
fn the_limiter_is_implemented_in_four_files() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    rust_files(&root.join("src"), &mut files);
    let mut implementing: Vec<String> = files
        .iter()
        .filter(|file| {
            let code = code_of(&fs::read_to_string(file).expect("a source file"));
            code.lines()
                .any(|line| line.trim_start().starts_with("impl Limiter {"))
        })
        .map(|file| {
            let path = file.strip_prefix(root).expect("under the crate");
            path.display().to_string()
        })
        .collect();
    implementing.sort();
    assert_eq!(
        implementing,
        [
            "src/limiter/judge.rs",
            "src/limiter/mod.rs",
            "src/limiter/operate.rs",
            "src/limiter/prepare.rs",
        ],
        "files with `impl Limiter`"
    );
}
