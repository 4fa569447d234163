//! The module graph's two laws, read from the source: no file imports, through any chain
//! of imports, from itself (no cycle), and no module imports from a layer above its own
//! ([`LAYERS`], bottom first). A new module needs a row here; a new import that breaks a
//! law fails with the file, the path it names and why.
//!
//! An import is any path into this crate a file names: in `use` items, in code, and in
//! the tokens of macro calls (`crate::…`, `super::…`, `self::…`). A path is resolved to
//! the file that defines what it names, following `pub use` re-exports of a module's
//! `mod.rs`; declaring a child module (`mod x;`) is not an import of it.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use proc_macro2::{TokenStream, TokenTree};
use syn::visit::Visit;

/// The crate's modules by layer, the lowest first: a top-level module, or one of its
/// files where that file stands higher than its siblings. A module may import from its
/// own layer's other modules and from the layers below, never from one above.
const LAYERS: &[(&str, &[&str])] = &[
    (
        "foundations: values, time, storage and the input's format",
        &["clock", "duration", "ids", "telemetry", "storage", "validate"],
    ),
    ("the records: files, uploads, idempotency keys, batches", &["idempotency", "files", "uploads", "batches"]),
    ("what is counted and what the backlog needs", &["metrics", "capacity"]),
    ("the pure rules of webhooks and of concurrency", &["webhooks", "concurrency"]),
    ("the configuration, typed", &["config"]),
    ("who may do what: projects, quotas, webhook delivery", &["projects", "quota", "dev", "webhooks::deliver"]),
    ("running lines against upstreams", &["exec"]),
    ("dividing capacity, and the lifecycle's decisions", &["grants", "lifecycle"]),
    ("driving batches through their lifecycle", &["drive"]),
    ("the surfaces: HTTP, Kubernetes, serve's runtime", &["api", "k8s", "serve_runtime"]),
    ("the roles of the binary", &["roles"]),
    ("the command line", &["cli"]),
];

/// A module of the crate, as the path of its segments (`["exec", "upstream"]`).
type Module = Vec<String>;

struct Source {
    file: PathBuf,
    module: Module,
    syntax: syn::File,
}

fn crate_sources() -> Vec<Source> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    let mut dirs = vec![src.clone()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") && path != src.join("main.rs") {
                files.push(path);
            }
        }
    }
    files.sort();
    files
        .into_iter()
        .map(|file| {
            let relative = file.strip_prefix(&src).unwrap().with_extension("");
            let mut module: Module = relative.iter().map(|s| s.to_string_lossy().into_owned()).collect();
            if matches!(module.last().map(String::as_str), Some("mod" | "lib")) {
                module.pop();
            }
            let text = std::fs::read_to_string(&file).unwrap();
            let syntax = syn::parse_file(&text).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
            Source { file, module, syntax }
        })
        .collect()
}

/// The paths into the crate that a file names, made absolute, each with where it was named.
#[derive(Default)]
struct Paths {
    module: Module,
    found: Vec<Vec<String>>,
    /// `pub use` re-exports: the name exported, and the absolute path it stands for.
    exports: Vec<(String, Vec<String>)>,
}

impl Paths {
    /// `segments` absolute, if it is a path into this crate.
    fn absolute(&self, segments: &[String]) -> Option<Vec<String>> {
        let (first, rest) = segments.split_first()?;
        match first.as_str() {
            "crate" => Some(rest.to_vec()),
            "self" => Some(self.module.iter().chain(rest).cloned().collect()),
            "super" => {
                let mut base = self.module.clone();
                let mut rest = segments;
                while rest.first().is_some_and(|s| s == "super") {
                    base.pop()?;
                    rest = &rest[1..];
                }
                Some(base.into_iter().chain(rest.iter().cloned()).collect())
            }
            _ => None,
        }
    }

    fn add(&mut self, segments: &[String]) {
        if let Some(path) = self.absolute(segments) {
            self.found.push(path);
        }
    }

    fn use_tree(&mut self, prefix: &mut Vec<String>, tree: &syn::UseTree, public: bool) {
        match tree {
            syn::UseTree::Path(path) => {
                prefix.push(path.ident.to_string());
                self.use_tree(prefix, &path.tree, public);
                prefix.pop();
            }
            syn::UseTree::Name(name) => self.used(prefix, &name.ident.to_string(), &name.ident.to_string(), public),
            syn::UseTree::Rename(rename) => {
                self.used(prefix, &rename.ident.to_string(), &rename.rename.to_string(), public)
            }
            syn::UseTree::Glob(_) => self.add(prefix),
            syn::UseTree::Group(group) => group.items.iter().for_each(|tree| self.use_tree(prefix, tree, public)),
        }
    }

    fn used(&mut self, prefix: &[String], name: &str, exported_as: &str, public: bool) {
        let mut path = prefix.to_vec();
        if name != "self" {
            path.push(name.to_string());
        }
        if let Some(absolute) = self.absolute(&path) {
            if public {
                self.exports.push((exported_as.to_string(), absolute.clone()));
            }
            self.found.push(absolute);
        }
    }

    /// `crate :: a :: b` and the like inside a macro call's tokens.
    fn tokens(&mut self, tokens: TokenStream) {
        let trees: Vec<TokenTree> = tokens.into_iter().collect();
        let mut i = 0;
        while i < trees.len() {
            match &trees[i] {
                TokenTree::Group(group) => self.tokens(group.stream()),
                TokenTree::Ident(ident) if ["crate", "super", "self"].contains(&ident.to_string().as_str()) => {
                    let mut segments = vec![ident.to_string()];
                    while let (Some(TokenTree::Punct(a)), Some(TokenTree::Punct(b)), Some(TokenTree::Ident(next))) =
                        (trees.get(i + 1), trees.get(i + 2), trees.get(i + 3))
                    {
                        if a.as_char() != ':' || b.as_char() != ':' {
                            break;
                        }
                        segments.push(next.to_string());
                        i += 3;
                    }
                    if segments.len() > 1 {
                        self.add(&segments);
                    }
                }
                _ => {}
            }
            i += 1;
        }
    }
}

impl<'ast> Visit<'ast> for Paths {
    fn visit_item_use(&mut self, item: &'ast syn::ItemUse) {
        let public = !matches!(item.vis, syn::Visibility::Inherited);
        self.use_tree(&mut Vec::new(), &item.tree, public);
    }

    fn visit_path(&mut self, path: &'ast syn::Path) {
        let segments: Vec<String> = path.segments.iter().map(|s| s.ident.to_string()).collect();
        self.add(&segments);
        syn::visit::visit_path(self, path);
    }

    /// Inside an inline module (`mod tests { … }`), `super` and `self` are relative to it.
    fn visit_item_mod(&mut self, item: &'ast syn::ItemMod) {
        self.module.push(item.ident.to_string());
        syn::visit::visit_item_mod(self, item);
        self.module.pop();
    }

    fn visit_macro(&mut self, mac: &'ast syn::Macro) {
        self.tokens(mac.tokens.clone());
        syn::visit::visit_macro(self, mac);
    }
}

/// Every file's imports, as edges between modules (files).
struct Graph {
    files: BTreeMap<Module, PathBuf>,
    /// From a module to the modules it imports from, with a path that shows it.
    edges: BTreeMap<Module, BTreeMap<Module, String>>,
}

impl Graph {
    fn read() -> Self {
        let sources = crate_sources();
        let files: BTreeMap<Module, PathBuf> =
            sources.iter().map(|source| (source.module.clone(), source.file.clone())).collect();
        let mut named = BTreeMap::new();
        let mut exports: BTreeMap<(Module, String), Vec<String>> = BTreeMap::new();
        for source in &sources {
            let mut paths = Paths { module: source.module.clone(), ..Paths::default() };
            paths.visit_file(&source.syntax);
            for (name, target) in paths.exports {
                exports.insert((source.module.clone(), name), target);
            }
            named.insert(source.module.clone(), paths.found);
        }
        let mut edges: BTreeMap<Module, BTreeMap<Module, String>> = BTreeMap::new();
        for (module, paths) in named {
            for path in paths {
                let target = resolve(&files, &exports, &path, 0);
                // A module's items and its children's declarations are not imports.
                if target != module && !target.is_empty() {
                    edges.entry(module.clone()).or_default().entry(target).or_insert_with(|| path.join("::"));
                }
            }
        }
        Self { files, edges }
    }

    fn file(&self, module: &Module) -> String {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        self.files[module].strip_prefix(root).unwrap().display().to_string()
    }
}

/// The file that defines what `path` names: the longest prefix that is a module, then
/// through that module's re-exports.
fn resolve(
    files: &BTreeMap<Module, PathBuf>,
    exports: &BTreeMap<(Module, String), Vec<String>>,
    path: &[String],
    depth: usize,
) -> Module {
    let mut length = path.len();
    while length > 0 && !files.contains_key(&path[..length]) {
        length -= 1;
    }
    let module = path[..length].to_vec();
    match path.get(length) {
        Some(name) if depth < 8 => match exports.get(&(module.clone(), name.clone())) {
            Some(target) if target.as_slice() != path => resolve(files, exports, target, depth + 1),
            _ => module,
        },
        _ => module,
    }
}

/// The layer of a module: that of the longest row of [`LAYERS`] it falls under.
fn layer(module: &Module) -> Option<usize> {
    LAYERS
        .iter()
        .enumerate()
        .flat_map(|(layer, (_, rows))| rows.iter().map(move |row| (layer, row.split("::").collect::<Vec<_>>())))
        .filter(|(_, row)| row.len() <= module.len() && row.iter().zip(module).all(|(a, b)| *a == b))
        .max_by_key(|(_, row)| row.len())
        .map(|(layer, _)| layer)
}

#[test]
fn every_module_has_a_layer() {
    let graph = Graph::read();
    let missing: BTreeSet<&String> =
        graph.files.keys().filter(|m| !m.is_empty() && layer(m).is_none()).map(|m| &m[0]).collect();
    assert!(missing.is_empty(), "modules without a row in LAYERS (tests/architecture.rs): {missing:?}");
}

#[test]
fn no_module_imports_from_a_layer_above_its_own() {
    let graph = Graph::read();
    let mut upward = Vec::new();
    for (from, targets) in &graph.edges {
        for (to, path) in targets {
            if let (Some(here), Some(there)) = (layer(from), layer(to))
                && there > here
            {
                upward.push(format!(
                    "{} (layer {here}, {}) imports crate::{path} from {} (layer {there}, {})",
                    graph.file(from),
                    LAYERS[here].0,
                    graph.file(to),
                    LAYERS[there].0
                ));
            }
        }
    }
    assert!(upward.is_empty(), "{} imports run up the layers:\n{}", upward.len(), upward.join("\n"));
}

#[test]
fn no_file_imports_from_itself_through_others() {
    let graph = Graph::read();
    let cycles = cycles(&graph.edges);
    let mut described = Vec::new();
    for cycle in &cycles {
        for from in cycle {
            for (to, path) in graph.edges[from].iter().filter(|(to, _)| cycle.contains(*to)) {
                described.push(format!("  {} -> {}: crate::{path}", graph.file(from), graph.file(to)));
            }
        }
        described.push(String::new());
    }
    assert!(cycles.is_empty(), "{} cycles:\n{}", cycles.len(), described.join("\n"));
}

/// The strongly connected components of more than one module (Tarjan's algorithm).
fn cycles(edges: &BTreeMap<Module, BTreeMap<Module, String>>) -> Vec<BTreeSet<Module>> {
    struct Search<'a> {
        edges: &'a BTreeMap<Module, BTreeMap<Module, String>>,
        index: BTreeMap<&'a Module, usize>,
        low: BTreeMap<&'a Module, usize>,
        stack: Vec<&'a Module>,
        on_stack: BTreeSet<&'a Module>,
        found: Vec<BTreeSet<Module>>,
    }
    impl<'a> Search<'a> {
        fn visit(&mut self, module: &'a Module) {
            let index = self.index.len();
            self.index.insert(module, index);
            self.low.insert(module, index);
            self.stack.push(module);
            self.on_stack.insert(module);
            for next in self.edges.get(module).into_iter().flat_map(BTreeMap::keys) {
                if !self.index.contains_key(next) {
                    self.visit(next);
                    let low = self.low[module].min(self.low[next]);
                    self.low.insert(module, low);
                } else if self.on_stack.contains(next) {
                    let low = self.low[module].min(self.index[next]);
                    self.low.insert(module, low);
                }
            }
            if self.low[module] == self.index[module] {
                let mut component = BTreeSet::new();
                while let Some(top) = self.stack.pop() {
                    self.on_stack.remove(top);
                    component.insert(top.clone());
                    if top == module {
                        break;
                    }
                }
                if component.len() > 1 {
                    self.found.push(component);
                }
            }
        }
    }
    let mut search = Search {
        edges,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        found: Vec::new(),
    };
    for module in edges.keys() {
        if !search.index.contains_key(module) {
            search.visit(module);
        }
    }
    search.found
}
