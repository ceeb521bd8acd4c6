//! The schema's versions, applied on connect.
//!
//! Each migration is a SQL file embedded in the binary. On every connect, one transaction takes
//! a transaction-scoped advisory lock (so two coordinators starting at once take turns: the
//! second finds everything applied), reads the newest applied version, refuses a database newer
//! than this binary knows, and applies what is missing, recording each.

use tokio_postgres::Client;

use super::connect::{error_text, Target};
use crate::service::store::backend::BackendError;

/// Every migration this binary knows, oldest first: version, name, SQL.
pub const MIGRATIONS: &[(i32, &str, &str)] =
    &[(1, "initial", include_str!("migrations/0001_initial.sql"))];

/// The advisory lock key that serialises migrations ("flotilla" in ASCII).
const MIGRATION_LOCK: i64 = 0x666c_6f74_696c_6c61;

/// The newest version this binary knows.
pub fn newest_known() -> i32 {
    MIGRATIONS.last().map_or(0, |m| m.0)
}

/// Brings the schema up to date; returns the versions it applied (none when it was current).
pub(crate) async fn migrate(
    target: &Target,
    client: &mut Client,
) -> Result<Vec<i32>, BackendError> {
    let fail = |what: &str, e: tokio_postgres::Error| {
        BackendError::failed(
            &target.describe,
            format!("cannot migrate the schema: {what}: {}", error_text(&e)),
        )
    };
    let tx = client.transaction().await.map_err(|e| fail("begin", e))?;
    tx.execute("SELECT pg_advisory_xact_lock($1)", &[&MIGRATION_LOCK])
        .await
        .map_err(|e| fail("take the migration lock", e))?;
    tx.batch_execute(
        "CREATE TABLE IF NOT EXISTS migrations (
             version    integer     PRIMARY KEY,
             name       text        NOT NULL,
             applied_at timestamptz NOT NULL DEFAULT now()
         )",
    )
    .await
    .map_err(|e| fail("create the migrations table", e))?;
    let row = tx
        .query_one("SELECT coalesce(max(version), 0) FROM migrations", &[])
        .await
        .map_err(|e| fail("read the applied version", e))?;
    let applied: i32 = row
        .try_get(0)
        .map_err(|e| fail("read the applied version", e))?;
    let known = newest_known();
    if applied > known {
        return Err(BackendError::failed(
            &target.describe,
            format!(
                "the database's schema is at version {applied}, newer than this flotilla knows \
                 (version {known}): refusing to use it; run a flotilla at least as new as the one \
                 that migrated it"
            ),
        ));
    }
    let mut done = Vec::new();
    for (version, name, sql) in MIGRATIONS.iter().filter(|m| m.0 > applied) {
        tx.batch_execute(sql)
            .await
            .map_err(|e| fail(&format!("apply {version:04}_{name}"), e))?;
        tx.execute(
            "INSERT INTO migrations (version, name) VALUES ($1, $2)",
            &[version, name],
        )
        .await
        .map_err(|e| fail(&format!("record {version:04}_{name}"), e))?;
        done.push(*version);
    }
    tx.commit().await.map_err(|e| fail("commit", e))?;
    if !done.is_empty() {
        tracing::info!("{}: applied schema migrations {done:?}", target.describe);
    }
    Ok(done)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_grow_and_every_file_names_its_tables() {
        let versions: Vec<i32> = MIGRATIONS.iter().map(|m| m.0).collect();
        assert!(versions.windows(2).all(|w| w[0] < w[1]), "{versions:?}");
        assert_eq!(versions.first(), Some(&1));
        let initial = MIGRATIONS[0].2;
        for table in ["records", "lease", "coordinators"] {
            assert!(
                initial.contains(&format!("CREATE TABLE {table} ")),
                "{table}"
            );
        }
    }
}
