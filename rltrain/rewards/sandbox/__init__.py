"""Running model-written code safely: `Execution`s and their outcomes (`base`), bubblewrap or
rlimits-only processes on this machine (`local`), a SandboxFusion service by URL (`remote`), the
program that runs inside (`launcher`) and the settings a run hands its reward workers (`settings`).
The security model: docs/rewards-and-roles.md ("The sandbox")."""
