"""/v1/admission/validate: a Kubernetes validating admission webhook (admission.k8s.io/v1) that refuses pods
running engines Kiln would not serve — the decision is api/admission.py's; see docs/admission.md."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Body, Request
from starlette.concurrency import run_in_threadpool

from api.routes.keys import trusted_fingerprints
from kiln.errors import SpecError
from api.admission import engine_facts, registry_hosts, review
from workers.replicas import replica_facts, trusted_registries

router = APIRouter(tags=["admission"])


@router.post("/v1/admission/validate")
async def validate(request: Request, body: Any = Body(None)):
    """Admit or deny a Pod or workload by the engine images it names (AdmissionReview in, AdmissionReview out)."""
    # never the Host this request came in by: whoever calls the webhook would name the registry
    hosts, trusted = registry_hosts(request.app.state.settings.registry_hosts), trusted_fingerprints(request.app)
    allow_tags = request.app.state.settings.admission_allow_tags
    places = trusted_registries(request.app.state.settings.trusted_registries)

    def decide() -> dict:
        with request.app.state.read_sessions() as session:
            return review(body, hosts=hosts, allow_tags=allow_tags, trusted=trusted,
                          lookup=lambda ref: engine_facts(session, ref), trusted_registries=places,
                          replicas=lambda ref: replica_facts(session, ref.host or "", ref.repository, ref.digest))

    try:
        return await run_in_threadpool(decide)
    except ValueError as exc:
        raise SpecError(str(exc), field="request",
                        fix="send an admission.k8s.io/v1 AdmissionReview (the Kubernetes API server does)") from None
