//! `flotilla completions SHELL` and `flotilla man`: shell completions and the man page, made from
//! the command line's own definition, so they never disagree with it. Both are made in memory
//! and written like every other output, so a closed pipe ends them quietly.

use crate::cli::args::Cli;
use crate::cli::out::out;

/// The completion script for `shell` (bash, zsh, fish, elvish, powershell).
pub fn completions(shell: clap_complete::Shell) -> String {
    let mut command = Cli::command_scoped();
    let mut script = Vec::new();
    clap_complete::generate(shell, &mut command, "flotilla", &mut script);
    String::from_utf8_lossy(&script).into_owned()
}

/// The man page, `flotilla(1)`, in roff.
pub fn man() -> String {
    let mut page = Vec::new();
    // Rendering into memory cannot fail.
    let _ = clap_mangen::Man::new(Cli::command_scoped()).render(&mut page);
    String::from_utf8_lossy(&page).into_owned()
}

/// Prints `text` as it is.
pub fn print(text: &str) {
    out!("{text}");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn completions_and_the_man_page_know_the_commands() {
        let bash = completions(clap_complete::Shell::Bash);
        assert!(
            bash.contains("_flotilla()") && bash.contains("rollout"),
            "{bash}"
        );
        let zsh = completions(clap_complete::Shell::Zsh);
        assert!(zsh.contains("#compdef flotilla"), "{zsh}");
        let page = man();
        assert!(
            page.contains(".TH flotilla 1") && page.contains("rollout"),
            "{page}"
        );
    }
}
