//! Loading a scenario: read, parse, validate.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use crate::model::NodeSpec;
use crate::spec::ScenarioFile;
use crate::validate::validate;

const DEMO_TOML: &str = include_str!("../scenarios/demo.toml");

/// A validated fleet of simulated nodes.
#[derive(Debug, Clone, PartialEq)]
pub struct Scenario {
    nodes: Vec<NodeSpec>,
}

/// Why a scenario could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum ScenarioError {
    #[error("cannot read scenario file {}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// Not TOML, or not shaped like a scenario; the message names the line.
    #[error("cannot parse scenario: {0}")]
    Parse(String),
    /// Well-formed but contradictory; the message lists every problem, each
    /// naming its node, GPU, pid and field.
    #[error("invalid scenario: {0}")]
    Invalid(String),
}

impl ScenarioError {
    /// Prefixes the message with where the scenario came from.
    fn in_file(self, path: &Path) -> Self {
        match self {
            Self::Parse(message) => Self::Parse(format!("{}: {message}", path.display())),
            Self::Invalid(message) => Self::Invalid(format!("{}: {message}", path.display())),
            io @ Self::Io { .. } => io,
        }
    }
}

fn describe_problems(problems: &[String]) -> String {
    match problems {
        [only] => only.clone(),
        _ => {
            let mut message = format!("{} problems:", problems.len());
            for problem in problems {
                let _ = write!(message, "\n  - {problem}");
            }
            message
        }
    }
}

impl Scenario {
    pub fn from_toml_str(text: &str) -> Result<Scenario, ScenarioError> {
        let file: ScenarioFile = toml::from_str(text)
            .map_err(|err| ScenarioError::Parse(err.to_string().trim_end().to_owned()))?;
        let nodes = validate(file)
            .map_err(|problems| ScenarioError::Invalid(describe_problems(&problems)))?;
        Ok(Scenario { nodes })
    }

    /// Reads and validates a scenario file; every error names `path`.
    pub fn load(path: &Path) -> Result<Scenario, ScenarioError> {
        let text = std::fs::read_to_string(path).map_err(|source| ScenarioError::Io {
            path: path.to_owned(),
            source,
        })?;
        Self::from_toml_str(&text).map_err(|err| err.in_file(path))
    }

    /// The demo fleet shipped in `scenarios/demo.toml`.
    pub fn demo() -> Scenario {
        #[allow(clippy::expect_used)]
        // The file is compiled in and a unit test parses it, so this cannot
        // fail in a released build.
        Self::from_toml_str(DEMO_TOML).expect("the bundled scenarios/demo.toml is valid")
    }

    pub fn nodes(&self) -> &[NodeSpec] {
        &self.nodes
    }

    pub fn node(&self, name: &str) -> Option<&NodeSpec> {
        self.nodes.iter().find(|node| node.name == name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn demo_parses() {
        let demo = Scenario::from_toml_str(DEMO_TOML);
        assert!(demo.is_ok(), "{}", demo.unwrap_err());
        assert_eq!(Scenario::demo(), demo.unwrap());
    }

    #[test]
    fn load_names_the_path_in_every_error() {
        let dir = std::env::temp_dir().join(format!("headroom-sim-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();

        let missing = dir.join("missing.toml");
        let err = Scenario::load(&missing).unwrap_err();
        assert!(matches!(err, ScenarioError::Io { .. }));
        assert!(err.to_string().contains("missing.toml"), "{err}");

        let broken = dir.join("broken.toml");
        std::fs::write(&broken, "seed = 1\n[[node]\n").unwrap();
        let err = Scenario::load(&broken).unwrap_err();
        assert!(matches!(err, ScenarioError::Parse(_)));
        assert!(
            err.to_string().contains("broken.toml") && err.to_string().contains("line 2"),
            "{err}"
        );

        let invalid = dir.join("invalid.toml");
        std::fs::write(&invalid, "seed = 1\n").unwrap();
        let err = Scenario::load(&invalid).unwrap_err();
        assert!(matches!(err, ScenarioError::Invalid(_)));
        assert!(err.to_string().contains("invalid.toml"), "{err}");

        let good = dir.join("good.toml");
        std::fs::write(&good, DEMO_TOML).unwrap();
        assert_eq!(Scenario::load(&good).unwrap(), Scenario::demo());

        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn several_problems_are_listed() {
        let err = Scenario::from_toml_str(
            r#"
            [[node]]
            name = "a"
            [[node.gpu]]
            model = ""
            memory_total = 0
            "#,
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("2 problems") && err.contains("model") && err.contains("memory_total"),
            "{err}"
        );
    }
}
