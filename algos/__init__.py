"""The algorithms (``--algo NAME``): one file per algorithm, each an :class:`Algorithm` subclass with a ``name``,
registered here in grpo.foundation.plugins.ALGORITHMS by that name as ``module:Class`` (imported at first use), the
way every plug-in package registers its built-ins (grpo/foundation/registry.py). Adding an algorithm is adding its
file and its line below (tests/test_registry.py checks that every such class is here, under its own name).
"""

from __future__ import annotations

from grpo.foundation.plugins import ALGORITHMS

BUILT_IN = {
    "2-grpo": "algos.two_grpo:TwoGRPO",
    "bnpo": "algos.bnpo:BNPO",
    "cispo": "algos.cispo:CISPO",
    "clip-cov": "algos.clip_cov:ClipCov",
    "cppo": "algos.cppo:CPPO",
    "dapo": "algos.dapo:DAPO",
    "dcpo": "algos.dcpo:DCPO",
    "diver": "algos.diver:Diver",
    "dppo-kl": "algos.dppo_kl:DPPOKL",
    "dppo-tv": "algos.dppo_tv:DPPOTV",
    "drgrpo": "algos.drgrpo:DrGRPO",
    "dro": "algos.dro:DRO",
    "edge-grpo": "algos.edge_grpo:EdgeGRPO",
    "gdpo": "algos.gdpo:GDPO",
    "geo-mean": "algos.geo_mean:GeoMean",
    "gigpo": "algos.gigpo:GiGPO",
    "gpg": "algos.gpg:GPG",
    "grpo": "algos.grpo:GRPO",
    "grpo-lambda": "algos.grpo_lambda:GRPOLambda",
    "grpo-lead": "algos.grpo_lead:GRPOLead",
    "grpo-passk": "algos.grpo_passk:GRPOPassK",
    "grpo-ps": "algos.grpo_ps:GRPOPS",
    "grpo-s": "algos.grpo_s:GRPOS",
    "gspo": "algos.gspo:GSPO",
    "gspo-token": "algos.gspo_token:GSPOToken",
    "gtpo": "algos.gtpo:GTPO",
    "kl-cov": "algos.kl_cov:KLCov",
    "lambda-grpo": "algos.lambda_grpo:LambdaGRPO",
    "luspo": "algos.luspo:LUSPO",
    "mt-grpo": "algos.mt_grpo:MTGRPO",
    "opd": "algos.opd:OPD",
    "opo": "algos.opo:OPO",
    "optimal-token-baseline": "algos.optimal_token_baseline:OptimalTokenBaseline",
    "prorl": "algos.prorl:ProRL",
    "pspo": "algos.pspo:PSPO",
    "reinforce-pp": "algos.reinforce_pp:ReinforcePP",
    "reinforce-pp-baseline": "algos.reinforce_pp_baseline:ReinforcePPBaseline",
    "remax": "algos.remax:ReMax",
    "rloo": "algos.rloo:RLOO",
    "sapo": "algos.sapo:SAPO",
    "tic-grpo": "algos.tic_grpo:TICGRPO",
    "vespo": "algos.vespo:VESPO",
}
for _name, _target in BUILT_IN.items():
    ALGORITHMS.register(_name, _target)
