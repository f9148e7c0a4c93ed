//! stormguard: Tower middleware that retries without making things worse.
