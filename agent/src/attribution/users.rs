//! uid → user name, memoised.
//!
//! Names come from the agent's own NSS view: in a container that is the
//! image's `/etc/passwd` (plus whatever NSS modules it ships), not the
//! host's, so deployments that want host user names mount the host's
//! passwd database or run the agent on the host. Unknown uids are reported
//! as the number.

use std::collections::HashMap;
use std::fmt;

/// Looks a uid up; `None` when no name is known.
pub type UserNameResolver = Box<dyn Fn(u32) -> Option<String> + Send>;

/// The system's NSS lookup (`getpwuid_r`), which may be a network call
/// (LDAP, sssd) on cluster nodes; hence [`UserNames`] memoises.
pub fn nss_user_name(uid: u32) -> Option<String> {
    uzers::get_user_by_uid(uid).map(|user| user.name().to_string_lossy().into_owned())
}

pub struct UserNames {
    resolve: UserNameResolver,
    /// Misses are memoised too: container uids are often unknown to the
    /// host, and asking again for each new process would repeat a slow miss.
    names: HashMap<u32, String>,
}

impl UserNames {
    pub fn new(resolve: UserNameResolver) -> Self {
        Self {
            resolve,
            names: HashMap::new(),
        }
    }

    pub fn name(&mut self, uid: u32) -> String {
        self.names
            .entry(uid)
            .or_insert_with(|| (self.resolve)(uid).unwrap_or_else(|| uid.to_string()))
            .clone()
    }

    /// Forgets uids no live process uses, which bounds the memo and lets a
    /// user added or renamed since be looked up afresh once their old
    /// processes are gone.
    pub fn retain(&mut self, mut in_use: impl FnMut(u32) -> bool) {
        self.names.retain(|&uid, _| in_use(uid));
    }
}

impl fmt::Debug for UserNames {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UserNames")
            .field("names", &self.names)
            .finish_non_exhaustive()
    }
}
