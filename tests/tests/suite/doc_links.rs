//! The documentation's links lead somewhere. Every Markdown file in the
//! repository (outside `target/`, `node_modules/` and dot-directories) is
//! read; every inline link `[text](dest)`, image `![alt](dest)` and
//! reference definition `[label]: dest` outside code is resolved against the
//! file's folder and must name a file or folder that exists, and an
//! `#anchor` into a Markdown file must match one of its headings as GitHub
//! slugs them. Links with a scheme (`https:`, `mailto:`) are not followed.
//! All failures are reported at once, each with its file, line and reason.

use std::collections::HashMap;
use std::fs;
use std::path::{Component, Path, PathBuf};

/// Folders never searched for Markdown: build output, npm packages. Dot
/// folders (`.git`, `.ci`, caches) are skipped as well.
const SKIPPED_DIRS: [&str; 2] = ["target", "node_modules"];

/// A link destination as written, with the line it starts on (1-based).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Link {
    line: usize,
    dest: String,
}

#[test]
fn every_relative_link_in_the_markdown_resolves() {
    let Some(root) = Path::new(env!("CARGO_MANIFEST_DIR")).parent() else {
        panic!("the tests crate has no parent folder: no repository root");
    };
    let (checked, failures) = check_tree(root);
    assert!(
        checked > 0,
        "no Markdown file found under {}",
        root.display()
    );
    assert!(
        failures.is_empty(),
        "{} broken link(s) in the Markdown under {}:\n{}",
        failures.len(),
        root.display(),
        failures.join("\n")
    );
}

#[test]
fn slugs_follow_github() {
    assert_eq!(slug("Two commands"), "two-commands");
    assert_eq!(
        slug("Who may read the dashboard, and who may act"),
        "who-may-read-the-dashboard-and-who-may-act"
    );
    assert_eq!(
        slug("Side by side with Prometheus + Alertmanager (same run)"),
        "side-by-side-with-prometheus--alertmanager-same-run"
    );
    assert_eq!(
        slug("The write path in eight round trips (012e542 → f797234)"),
        "the-write-path-in-eight-round-trips-012e542--f797234"
    );
    assert_eq!(slug("`spool_dir` and_more"), "spool_dir-and_more");
    assert_eq!(slug("See [the API](api.md)"), "see-the-api");
    assert_eq!(slug("Alert latency: p99 ≤ 1 s"), "alert-latency-p99--1-s");
    let text = "# Intro\n\n## Setup\n\ntext\n\n## Setup\n\n### Setup\n\nTitle\n=====\n\n```\n# not a heading\n```\n";
    assert_eq!(
        heading_slugs(text),
        ["intro", "setup", "setup-1", "setup-2", "title"]
    );
}

#[test]
fn links_are_found_outside_code_only() {
    let text = "\
See [one](a.md) and ![two](img/b.png \"title\"), [three](<c d.md#x>).
Not `[code](nope.md)` nor ``[double `tick`](nope2.md)``, but [`code text`](e.md).
A span `that runs
over two lines [x](nope3.md)` then [f](f.md#anchor).
\\[escaped](nope4.md) [![badge](g.svg)](h.md)

```sh
[fenced](nope5.md)
```
[label]: i.md
~~~~
[tilde fenced](nope6.md)
~~~~
[web](https://example.com) [paren](j_(k).md)
";
    let found: Vec<(usize, String)> = extract_links(text)
        .into_iter()
        .map(|l| (l.line, l.dest))
        .collect();
    let expected: Vec<(usize, String)> = [
        (1, "a.md"),
        (1, "img/b.png"),
        (1, "c d.md#x"),
        (2, "e.md"),
        (4, "f.md#anchor"),
        (5, "h.md"),
        (5, "g.svg"),
        (10, "i.md"),
        (14, "https://example.com"),
        (14, "j_(k).md"),
    ]
    .into_iter()
    .map(|(n, d)| (n, d.to_owned()))
    .collect();
    assert_eq!(found, expected);
}

#[test]
fn the_checker_reports_dead_links_and_anchors() {
    let dir = std::env::temp_dir().join(format!(
        "headroom-doc-links-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or_default()
    ));
    let docs = dir.join("docs");
    fs::create_dir_all(&docs).expect("create a scratch folder");
    fs::create_dir_all(dir.join("target")).expect("create a scratch target folder");
    fs::write(
        dir.join("README.md"),
        "# Top\n\n## Two words\n\n[ok](docs/page.md#a-page) [ok](#two-words) [ok](docs/)\n\
         [dead](docs/missing.md) [bad anchor](docs/page.md#nowhere) [bad](#top-1)\n\
         ![missing image](docs/shot.png) [web](https://example.com/x.md)\n",
    )
    .expect("write README.md");
    fs::write(docs.join("page.md"), "# A page\n\n[up](../README.md#top)\n").expect("write page.md");
    fs::write(
        dir.join("target").join("skipped.md"),
        "[dead](nowhere.md)\n",
    )
    .expect("write target/skipped.md");

    let (checked, failures) = check_tree(&dir);
    let _ = fs::remove_dir_all(&dir);
    assert_eq!(checked, 2, "{failures:?}");
    assert_eq!(failures.len(), 4, "{failures:?}");
    assert!(failures[0].contains("README.md:6") && failures[0].contains("docs/missing.md"));
    assert!(failures[1].contains("#nowhere") && failures[1].contains("no heading"));
    assert!(failures[2].contains("#top-1"));
    assert!(failures[3].contains("README.md:7") && failures[3].contains("docs/shot.png"));
}

/// Checks every Markdown file under `root`; returns how many files were
/// read and one line per failure.
fn check_tree(root: &Path) -> (usize, Vec<String>) {
    let mut failures = Vec::new();
    let mut files = Vec::new();
    collect_markdown(root, &mut files, &mut failures);
    files.sort();
    let mut headings: HashMap<PathBuf, Result<Vec<String>, String>> = HashMap::new();
    let mut checked = 0;
    for file in &files {
        let shown = file
            .strip_prefix(root)
            .unwrap_or(file)
            .display()
            .to_string();
        let text = match fs::read_to_string(file) {
            Ok(text) => text,
            Err(e) => {
                failures.push(format!("{shown}: cannot be read: {e}"));
                continue;
            }
        };
        checked += 1;
        for link in extract_links(&text) {
            if let Err(reason) = check_link(root, file, &text, &link, &mut headings) {
                failures.push(format!("{shown}:{}: ({}) {reason}", link.line, link.dest));
            }
        }
    }
    (checked, failures)
}

/// Every `.md` file under `dir`, skipping build output, npm packages and
/// dot-directories; symbolic links to folders are not followed.
fn collect_markdown(dir: &Path, files: &mut Vec<PathBuf>, failures: &mut Vec<String>) {
    let entries = match fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) => {
            failures.push(format!("{}: cannot be listed: {e}", dir.display()));
            return;
        }
    };
    for entry in entries {
        let entry = match entry {
            Ok(entry) => entry,
            Err(e) => {
                failures.push(format!("{}: cannot be listed: {e}", dir.display()));
                continue;
            }
        };
        let name = entry.file_name();
        let name = name.to_string_lossy();
        let path = entry.path();
        match entry.file_type() {
            Ok(kind) if kind.is_dir() => {
                if !name.starts_with('.') && !SKIPPED_DIRS.contains(&name.as_ref()) {
                    collect_markdown(&path, files, failures);
                }
            }
            Ok(_) => {
                if path.extension().is_some_and(|ext| ext == "md") {
                    files.push(path);
                }
            }
            Err(e) => failures.push(format!("{}: cannot be inspected: {e}", path.display())),
        }
    }
}

/// Resolves one link found in `file` (whose text is `text`).
fn check_link(
    root: &Path,
    file: &Path,
    text: &str,
    link: &Link,
    headings: &mut HashMap<PathBuf, Result<Vec<String>, String>>,
) -> Result<(), String> {
    let dest = link.dest.trim();
    if dest.is_empty() {
        return Err("empty link".to_owned());
    }
    if has_scheme(dest) || dest.starts_with("//") {
        return Ok(());
    }
    let (path_part, anchor) = match dest.split_once('#') {
        Some((path, anchor)) => (path, Some(anchor)),
        None => (dest, None),
    };
    let path_part = path_part.split_once('?').map_or(path_part, |(p, _)| p);
    let path_part = percent_decode(path_part);
    let target = if path_part.is_empty() {
        file.to_path_buf()
    } else if let Some(from_root) = path_part.strip_prefix('/') {
        root.join(from_root)
    } else {
        file.parent().unwrap_or(root).join(&path_part)
    };
    let target = normalize(&target);
    if !target.exists() {
        let shown = target.strip_prefix(root).unwrap_or(&target);
        return Err(format!("no such file or folder: {}", shown.display()));
    }
    let Some(anchor) = anchor else {
        return Ok(());
    };
    let is_markdown = target.is_file() && target.extension().is_some_and(|ext| ext == "md");
    if !is_markdown {
        return Ok(());
    }
    let anchor = percent_decode(anchor);
    let slugs = headings.entry(target.clone()).or_insert_with(|| {
        if target == normalize(file) {
            Ok(heading_slugs(text))
        } else {
            fs::read_to_string(&target)
                .map(|t| heading_slugs(&t))
                .map_err(|e| format!("cannot read {}: {e}", target.display()))
        }
    });
    match slugs {
        Ok(slugs) if slugs.contains(&anchor) => Ok(()),
        Ok(_) => Err(format!(
            "no heading of {} slugs to #{anchor}",
            target.strip_prefix(root).unwrap_or(&target).display()
        )),
        Err(e) => Err(e.clone()),
    }
}

/// `scheme:` at the start of a destination (`https:`, `mailto:`, `data:`),
/// before any `/`, `?` or `#`.
fn has_scheme(dest: &str) -> bool {
    let Some((scheme, _)) = dest.split_once(':') else {
        return false;
    };
    let mut chars = scheme.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphabetic())
        && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'))
}

/// `%20` and friends back to bytes; anything malformed is kept as written.
fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' && i + 2 < bytes.len() {
            let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).ok();
            if let Some(value) = hex.and_then(|h| u8::from_str_radix(h, 16).ok()) {
                out.push(value);
                i += 3;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Removes `.` and `..` components without touching the file system, so a
/// link through a folder that does not exist is not resolved by accident.
fn normalize(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for component in path.components() {
        match component {
            Component::CurDir => {}
            Component::ParentDir => {
                if !out.pop() {
                    out.push("..");
                }
            }
            other => out.push(other.as_os_str()),
        }
    }
    out
}

/// The opening fence of a fenced code block: up to three spaces, then three
/// or more backticks or tildes. Returns the fence character and its length.
fn fence_open(line: &str) -> Option<(char, usize)> {
    let indent = line.len() - line.trim_start_matches(' ').len();
    if indent > 3 {
        return None;
    }
    let rest = &line[indent..];
    let c = rest.chars().next().filter(|c| *c == '`' || *c == '~')?;
    let run = rest.chars().take_while(|x| *x == c).count();
    if run < 3 || (c == '`' && rest[run..].contains('`')) {
        return None;
    }
    Some((c, run))
}

/// Whether `line` closes a fence opened with `run` times `c`.
fn fence_closes(line: &str, c: char, run: usize) -> bool {
    let trimmed = line.trim();
    let indent = line.len() - line.trim_start_matches(' ').len();
    indent <= 3
        && trimmed.chars().take_while(|x| *x == c).count() >= run
        && trimmed.chars().all(|x| x == c)
}

/// The text outside fenced code blocks, as paragraphs (runs of non-blank
/// lines) with the line number of each paragraph's first line.
fn paragraphs(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    let mut current: Option<(usize, String)> = None;
    let mut fence: Option<(char, usize)> = None;
    for (index, line) in text.lines().enumerate() {
        if let Some((c, run)) = fence {
            if fence_closes(line, c, run) {
                fence = None;
            }
            continue;
        }
        if let Some(open) = fence_open(line) {
            out.extend(current.take());
            fence = Some(open);
            continue;
        }
        if line.trim().is_empty() {
            out.extend(current.take());
            continue;
        }
        match &mut current {
            Some((_, para)) => {
                para.push('\n');
                para.push_str(line);
            }
            None => current = Some((index + 1, line.to_owned())),
        }
    }
    out.extend(current);
    out
}

/// `chars` with the content of every inline code span (`` `x` ``,
/// ``` ``x`` ```) replaced by spaces, newlines kept. A backtick run without a
/// closing run of the same length is literal text.
fn blank_code_spans(chars: &[char]) -> Vec<char> {
    let mut out = chars.to_vec();
    let mut i = 0;
    while i < chars.len() {
        if chars[i] == '\\' {
            i += 2;
            continue;
        }
        if chars[i] != '`' {
            i += 1;
            continue;
        }
        let run = chars[i..].iter().take_while(|c| **c == '`').count();
        let mut j = i + run;
        let mut closed = None;
        while j < chars.len() {
            if chars[j] == '`' {
                let other = chars[j..].iter().take_while(|c| **c == '`').count();
                if other == run {
                    closed = Some(j);
                    break;
                }
                j += other;
            } else {
                j += 1;
            }
        }
        match closed {
            Some(end) => {
                for c in &mut out[i..end + run] {
                    if *c != '\n' {
                        *c = ' ';
                    }
                }
                i = end + run;
            }
            None => i += run,
        }
    }
    out
}

/// Every link, image and reference definition in Markdown `text`, outside
/// fenced code blocks and inline code, in the order they appear.
fn extract_links(text: &str) -> Vec<Link> {
    let mut links = Vec::new();
    for (first_line, para) in paragraphs(text) {
        let raw: Vec<char> = para.chars().collect();
        let chars = blank_code_spans(&raw);
        let line_at = |pos: usize| first_line + chars[..pos].iter().filter(|c| **c == '\n').count();
        let mut line_start = 0;
        for (i, c) in chars.iter().enumerate() {
            let at_line_start = i == line_start;
            if *c == '\n' {
                line_start = i + 1;
            }
            if *c != '[' || (i > 0 && chars[i - 1] == '\\') {
                continue;
            }
            let Some(close) = matching_bracket(&chars, i) else {
                continue;
            };
            if chars.get(close + 1) == Some(&'(') {
                if let Some(dest) = inline_destination(&chars, close + 2) {
                    links.push(Link {
                        line: line_at(i),
                        dest,
                    });
                }
            } else if chars.get(close + 1) == Some(&':')
                && at_line_start_or_indented(&chars, i, at_line_start, line_start)
            {
                let rest: String = chars[close + 2..]
                    .iter()
                    .take_while(|c| **c != '\n')
                    .collect();
                if let Some(dest) = rest.split_whitespace().next() {
                    let dest = dest.trim_start_matches('<').trim_end_matches('>');
                    links.push(Link {
                        line: line_at(i),
                        dest: dest.to_owned(),
                    });
                }
            }
        }
    }
    links
}

/// A reference definition starts its line, after at most three spaces.
fn at_line_start_or_indented(
    chars: &[char],
    i: usize,
    at_line_start: bool,
    line_start: usize,
) -> bool {
    at_line_start
        || (i >= line_start
            && i - line_start <= 3
            && chars[line_start..i].iter().all(|c| *c == ' '))
}

/// The `]` that closes the `[` at `open`, counting nested brackets and
/// skipping escaped ones.
fn matching_bracket(chars: &[char], open: usize) -> Option<usize> {
    let mut depth = 0usize;
    let mut i = open;
    while i < chars.len() {
        match chars[i] {
            '\\' => i += 1,
            '[' => depth += 1,
            ']' => {
                depth -= 1;
                if depth == 0 {
                    return Some(i);
                }
            }
            _ => {}
        }
        i += 1;
    }
    None
}

/// The destination of an inline link whose `(` ends just before `start`:
/// `<any text>`, or text up to whitespace or the `)` that balances the
/// opening one. A title after it is ignored.
fn inline_destination(chars: &[char], start: usize) -> Option<String> {
    let mut i = start;
    while chars.get(i).is_some_and(|c| c.is_whitespace()) {
        i += 1;
    }
    if chars.get(i) == Some(&'<') {
        let end = chars[i + 1..]
            .iter()
            .position(|c| *c == '>' || *c == '\n')?;
        if chars[i + 1 + end] != '>' {
            return None;
        }
        return Some(chars[i + 1..i + 1 + end].iter().collect());
    }
    let mut depth = 0usize;
    let mut dest = String::new();
    while let Some(&c) = chars.get(i) {
        match c {
            '\\' => {
                if let Some(&next) = chars.get(i + 1) {
                    dest.push(next);
                    i += 1;
                }
            }
            '(' => {
                depth += 1;
                dest.push(c);
            }
            ')' if depth == 0 => return Some(dest),
            ')' => {
                depth -= 1;
                dest.push(c);
            }
            c if c.is_whitespace() => {
                let rest: String = chars[i..].iter().collect();
                return rest.contains(')').then_some(dest);
            }
            c => dest.push(c),
        }
        i += 1;
    }
    None
}

/// The anchors GitHub gives the headings of Markdown `text`, in order:
/// ATX (`## Title`) and setext (`Title` over `===` or `---`) headings outside
/// fenced code, slugged, with `-1`, `-2`, … on repeats.
fn heading_slugs(text: &str) -> Vec<String> {
    let mut titles = Vec::new();
    let mut fence: Option<(char, usize)> = None;
    let mut previous: Option<&str> = None;
    for line in text.lines() {
        if let Some((c, run)) = fence {
            if fence_closes(line, c, run) {
                fence = None;
            }
            previous = None;
            continue;
        }
        if let Some(open) = fence_open(line) {
            fence = Some(open);
            previous = None;
            continue;
        }
        if let Some(title) = atx_heading(line) {
            titles.push(title);
            previous = None;
            continue;
        }
        let trimmed = line.trim();
        let underline = !trimmed.is_empty()
            && line.len() - line.trim_start().len() <= 3
            && (trimmed.chars().all(|c| c == '=') || trimmed.chars().all(|c| c == '-'));
        if underline && let Some(title) = previous.take() {
            titles.push(title.trim().to_owned());
            continue;
        }
        let is_text = !trimmed.is_empty() && !trimmed.starts_with('|') && !trimmed.starts_with('>');
        previous = is_text.then_some(line);
    }
    let mut seen: HashMap<String, usize> = HashMap::new();
    let mut slugs = Vec::new();
    for title in titles {
        let base = slug(&title);
        let mut unique = base.clone();
        if let Some(count) = seen.get(&base).copied() {
            let mut n = count;
            loop {
                n += 1;
                unique = format!("{base}-{n}");
                if !seen.contains_key(&unique) {
                    break;
                }
            }
            seen.insert(base, n);
        }
        seen.insert(unique.clone(), 0);
        slugs.push(unique);
    }
    slugs
}

/// The title of an ATX heading line (`#` to `######`, then a space or the
/// end of the line), without its closing `#`s.
fn atx_heading(line: &str) -> Option<String> {
    let indent = line.len() - line.trim_start_matches(' ').len();
    if indent > 3 {
        return None;
    }
    let rest = &line[indent..];
    let level = rest.chars().take_while(|c| *c == '#').count();
    if level == 0 || level > 6 {
        return None;
    }
    let title = &rest[level..];
    if !(title.is_empty() || title.starts_with(' ') || title.starts_with('\t')) {
        return None;
    }
    let title = title.trim();
    let without_closing = title.trim_end_matches('#');
    let title = if without_closing.is_empty() || without_closing.ends_with(' ') {
        without_closing.trim_end()
    } else {
        title
    };
    Some(title.to_owned())
}

/// GitHub's anchor for a heading: the rendered text (a link's text, not its
/// destination) lowercased, every character dropped that is not a letter,
/// digit, space, hyphen or underscore, then each space made a hyphen.
fn slug(title: &str) -> String {
    let chars: Vec<char> = title.trim().chars().collect();
    let mut text = String::new();
    let mut i = 0;
    while i < chars.len() {
        if chars[i] == '['
            && let Some(close) = matching_bracket(&chars, i)
            && chars.get(close + 1) == Some(&'(')
            && let Some(end) = chars[close + 2..].iter().position(|c| *c == ')')
        {
            text.extend(&chars[i + 1..close]);
            i = close + 2 + end + 1;
            continue;
        }
        text.push(chars[i]);
        i += 1;
    }
    text.to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || matches!(c, ' ' | '-' | '_'))
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}
