"""The `mlx-diloco` command line."""

import argparse
import os
import signal
import sys
import threading
import time
from dataclasses import fields
from pathlib import Path

from .cluster.launch_options import LaunchOptions
from .cluster.protocol import DEFAULT_PORT
from .dashboard.server import DEFAULT_PORT as DASHBOARD_PORT
from .config import ConfigError, TrainConfig
from .options import NumberOrAuto, WholeOrAuto
from .records import SUMMARY

def add_config_flags(parser):
    """A flag for every config key, and for every option of every strategy (strategies/), each
    with the help its field carries (options.option)."""
    from .strategies import STRATEGIES  # imports MLX: only once the parser is built (after the BLAS re-exec)
    parser.add_argument("--config", help="JSON or YAML file with config keys; YAML may use mlx_lm.lora's "
                                             "(flags given here override it)")
    names = []
    for f in fields(TrainConfig):
        listed = f": {', '.join(STRATEGIES)}" if f.name == "strategy" else ""  # the registered strategies
        names += add_flag(parser, f, f.metadata["help"] + listed)
    owners = {}  # option name -> {(its help, its default): the strategies that have it so}
    for name, cls in STRATEGIES.items():
        for f in fields(cls):
            owners.setdefault(f.name, {}).setdefault((f.metadata["help"], f.default), []).append(name)
    for option, kinds in owners.items():
        if option not in names:
            f = next(f for f in fields(STRATEGIES[next(iter(kinds.values()))[0]]) if f.name == option)
            names += add_flag(parser, f, shared_help(kinds))
    parser.set_defaults(config_keys=sorted(names))


def shared_help(kinds: dict) -> str:
    """The help of an option that several strategies have: each help once, with the strategies
    that give it and, where they differ, each one's default."""
    helps = {}
    for (text, default), strategies in kinds.items():
        helps.setdefault(text, []).append(f"{', '.join(strategies)}" + (f": default {default}" if len(kinds) > 1 else ""))
    return "; ".join(f"{text} ({'; '.join(who)})" for text, who in helps.items()) + \
        ("" if len(kinds) == 1 else " (default: the strategy's)")


def add_plan_flags(parser):
    """`plan`'s memory and what-if flags: config keys and its strategy's options, with plan's defaults."""
    from .tools.plan import FLAGS, STRATEGY, WHAT_IF
    from .strategies import strategy_class
    known = {f.name: f for f in (*fields(TrainConfig), *fields(strategy_class(STRATEGY)))}
    for name in FLAGS:
        add_flag(parser, known[name], known[name].metadata["help"], default=WHAT_IF.get(name))
    parser.set_defaults(config_keys=list(FLAGS))


def add_flag(parser, f, help: str, default=None) -> list:
    """The flag of option field `f` (none for a field that is no plain value, strategy_options);
    `default`: what the command takes when it is not given, if not the field's own (--help says it).
    Returns the names of the flags added."""
    if f.type not in (bool, int, float, str, NumberOrAuto, WholeOrAuto) or not f.metadata.get("flag", True):
        return []
    flag = "--" + f.name.replace("_", "-")
    if f.type is bool:
        parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=help)
    else:
        shown = "" if "(default:" in help else f" (default: {f.default if default is None else default})"
        parser.add_argument(flag, dest=f.name, type=f.type.parse if f.type in (NumberOrAuto, WholeOrAuto) else f.type,
                            default=None, help=help + shown, choices=f.metadata.get("choices"))
    return [f.name]


def given_flags(args, keys: str = "config_keys") -> dict:
    """The flags given of those the parser lists under `keys` (config_keys: the config's)."""
    return {k: getattr(args, k) for k in getattr(args, keys) if getattr(args, k) is not None}


def config_from_flags(args, defaults: dict = None) -> TrainConfig:
    """--config's keys, then `defaults` where neither names a key, then the flags given."""
    base = TrainConfig.from_file(args.config).to_dict() if args.config else {}
    return TrainConfig.from_dict({**(defaults or {}), **base, **given_flags(args)})


def config_from_args(args) -> TrainConfig:
    given = given_flags(args)
    if args.resume:
        if given or args.config:
            flags = " ".join("--" + k.replace("_", "-") for k in given) or "--config"
            raise ConfigError(f"--resume continues the run with its saved config; drop {flags}")
        from .training.resolve import saved_config
        return saved_config(Path(args.run_dir))
    return config_from_flags(args)


# ------------------------------------------------------------------ commands

def cmd_sim(args):
    from .training.processes import simulate
    if args.resume and not args.run_dir:
        raise ConfigError("--resume needs --run-dir naming the run to continue")
    config = config_from_args(args)
    run_dir = Path(args.run_dir or f"runs/{config.strategy}-x{config.workers}-{time.strftime('%Y%m%d-%H%M%S')}")
    args.on_interrupt = f"continue with: mlx-diloco sim --resume --run-dir {run_dir}"
    start_dashboard(args, run_dir)
    print_summary(simulate(config, run_dir, args.processes, args.resume, log=lambda m: print(m, file=sys.stderr)))
    from .models.zoo import load_spec
    if load_spec(config.model).is_language_model and args.sample_tokens:
        from .tools.generate import default_prompt, generate
        prompt = default_prompt(run_dir) if args.prompt is None else args.prompt
        print("\nsample:\n" + prompt + "".join(generate(run_dir, prompt, args.sample_tokens)))


def cmd_gym_list(args):
    from .gym.problems import PROBLEMS
    for p in PROBLEMS.values():
        c = p.settings(args.size)
        speeds = f", worker speeds {c['worker_speeds']}" if c.get("worker_speeds") else ""
        target = f"target eval loss {p.target_loss}" if p.target_loss is not None else "scored by held-out accuracy"
        print(f"{p.name:20} {p.about}\n{'':20} {c['model']} on {c['data']}, {c['workers']} workers x {c['steps']} "
              f"steps, link {c['link']}, {c['step_time']:g} s per step{speeds}; {target}")


def cmd_gym_run(args):
    from .gym import scorecard
    from .gym.problems import get_problem
    from .training.processes import simulate
    problem = get_problem(args.problem)
    if args.resume and not args.run_dir:
        raise ConfigError("--resume needs --run-dir naming the run to continue")
    log = lambda m: print(m, file=sys.stderr)  # noqa: E731
    strategy = args.strategy or (TrainConfig.from_file(args.config).strategy if args.config else None)
    config = config_from_args(args) if args.resume else config_from_flags(
        args, defaults=problem.prepared(args.size, log, strategy))
    run_dir = Path(args.run_dir or f"runs/gym/{problem.name}/{config.strategy}-{time.strftime('%Y%m%d-%H%M%S')}")
    args.on_interrupt = f"continue with: mlx-diloco gym run {problem.name} --resume --run-dir {run_dir}"
    start_dashboard(args, run_dir)
    simulate(config, run_dir, args.processes, args.resume, log=log)
    card = scorecard.scorecard(run_dir, problem)
    path = scorecard.save(card, run_dir)
    print(scorecard.describe(card) + f"\n  scorecard: {path}")


def cmd_gym_compare(args):
    from .gym import scorecard
    cards = [scorecard.load(p) for p in args.cards]
    print(scorecard.table(cards))
    if args.out:
        print(f"\nplot: {scorecard.plot(cards, Path(args.out), title=args.title)}")


def cmd_sweep(args):
    from .gym.problems import get_problem
    from .gym.sweep import grid_points, parse_grid, run_sweep
    from .gym import scorecard
    from .training.processes import simulate
    problem = get_problem(args.problem) if args.problem else None
    log = lambda m: print(m, file=sys.stderr)  # noqa: E731
    base = {**(problem.prepared(args.size, log) if problem else {}),
            **(TrainConfig.from_file(args.config).to_dict() if args.config else {}), **given_flags(args)}
    args.on_interrupt = "run the same command again to resume the sweep"
    cards = run_sweep(base, grid_points(parse_grid(args.grid)), Path(args.out),
                      train=lambda config, run_dir, resume: simulate(config, run_dir, args.processes, resume, log),
                      problem=problem, log=log)
    print(scorecard.table(cards) + f"\n\ntable: {Path(args.out) / 'sweep.md'}, plots: {Path(args.out) / 'sweep.png'}")


def cmd_worker(args):
    """One worker of a cluster job or of sim's processes (training/worker.py)."""
    from .training.worker import work
    if summary := work(args.job):
        print_summary(summary)


def cmd_agent(args):
    import logging
    from .cluster.agent import serve
    from .cluster.allowed import Allowed
    from .cluster.protocol import load_secret
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    state_dir = Path(args.state_dir)  # the Agent makes it absolute: its workers run in another folder
    folders = lambda given: tuple(Path(d).expanduser().resolve() for d in given)
    if args.code_dir and not args.allow_code:
        raise ConfigError("--code-dir names folders of code jobs may run, which this agent runs only with "
                          "--allow-code; pass --allow-code too, or drop --code-dir")
    allowed = Allowed(state_dir, models=folders(args.models_dir), data=folders(args.data_dir), code=args.allow_code,
                      code_dirs=folders(args.code_dir))
    serve(state_dir, load_secret(secret_file=args.secret_file), args.port, args.bind, mdns=not args.no_mdns,
          name=args.name, max_memory=args.max_memory and args.max_memory * 1e9, allowed=allowed)


def found_agents(args):
    """The agents named by --hosts (a list or a file), else those that answer on mDNS."""
    from .cluster.discovery import browse, parse_hosts
    if args.hosts:
        text = Path(args.hosts).read_text() if Path(args.hosts).is_file() else args.hosts
        return parse_hosts(text, DEFAULT_PORT)
    found = browse(args.discover_timeout)
    if not found:
        raise ConfigError(f"no agent answered on mDNS within {args.discover_timeout:.0f} s; start "
                          "'mlx-diloco agent' on each machine, or pass --hosts (Wi-Fi often blocks multicast)")
    return found


def cmd_discover(args):
    from .cluster.discovery import AgentClient, AgentError
    from .cluster.links import describe as describe_link
    from .cluster.protocol import given_secret
    secret = given_secret(args.secret_file)
    if args.hosts and secret is None:
        raise ConfigError("listed hosts can only be asked with the cluster secret: set MLX_DILOCO_SECRET or "
                          "pass --secret-file (without --hosts, discover lists what mDNS advertises)")
    answered = 0
    for f in found_agents(args):
        line = f"{f.endpoint:24s} {f.properties.get('host', '?') if f.properties else '?'}"
        if secret:
            try:
                a = AgentClient(f, secret).hello()
                nets = ", ".join(f"{i['name']} {i['kind']} {i['address']}" for i in a["interfaces"] if i["kind"] != "loopback")
                line = (f"{f.endpoint:24s} {a['host']}  mlx-diloco {a['version']}  {a['chip']}  "
                        f"{a['memory'] / 2**30:.0f} GiB  [{nets}]  thunderbolt links: {len(a['thunderbolt'])}")
                line += "".join(f"\n    {describe_link(record)}" for record in a.get("links", {}).values())
                answered += 1
            except (AgentError, ConfigError) as e:
                line += f"  (hello failed: {e})"
        elif f.properties:
            line += f"  mlx-diloco {f.properties.get('version')}  {f.properties.get('chip')}  [{f.properties.get('interfaces')}]"
            answered += 1
        print(line)
    if not answered:
        raise ConfigError("no agent answered; check that 'mlx-diloco agent' runs there, the address and port, "
                          "and that every machine has the same cluster secret")


def cmd_launch(args):
    from .cluster.launcher import JobFailed, JobState, Launcher
    from .cluster.supervisor import Supervisor
    from .gym.scorecard import post_training_summary, time_spent, time_split
    from .cluster.protocol import load_secret
    secret = load_secret(secret_file=args.secret_file)
    if args.resume:
        if not args.run_dir:
            raise ConfigError("--resume needs --run-dir naming the job to continue")
        launcher = Launcher(JobState.load(Path(args.run_dir)), Path(args.run_dir), secret,
                            log=lambda m: print(m, file=sys.stderr))
    else:
        from .cluster.discovery import Found
        from .cluster.hostfile import MlxHostfile
        from .cluster.launcher import dry_run
        if args.hostfile and args.hosts:
            raise ConfigError("--hosts and --hostfile both name the machines; pass one of them")
        mlx_file = MlxHostfile.read(args.hostfile) if args.hostfile else None  # its machines' agents, in its order
        found = [Found(h.agent_address, DEFAULT_PORT) for h in mlx_file.hosts] if mlx_file else found_agents(args)
        config = config_from_flags(args, defaults={"workers": len(found)})
        options = LaunchOptions(**given_flags(args, "launch_keys"), discover=not (args.hosts or mlx_file))
        if args.dry_run:
            print(dry_run(found, secret, config.workers, options.backend, mlx_file, log=lambda m: print(m, file=sys.stderr)))
            return
        run_dir = Path(args.run_dir or f"runs/cluster-{config.strategy}-x{config.workers}-{time.strftime('%Y%m%d-%H%M%S')}")
        launcher = Launcher.new(config, found, run_dir, secret, options, log=lambda m: print(m, file=sys.stderr),
                                mlx_file=mlx_file)
    args.on_interrupt = (f"the workers go on; watch them again with: mlx-diloco launch --resume "
                         f"--run-dir {launcher.run_dir}")
    start_dashboard(args, launcher.run_dir, secret)
    try:
        s = Supervisor(launcher).run(resume=args.resume)  # the job's life after its start
    except JobFailed as e:
        raise ConfigError(f"job failed: {e}")
    print(f"\njob {s[SUMMARY.job]} in {s[SUMMARY.run_dir]}: {s[SUMMARY.workers]} workers, {s[SUMMARY.steps]} steps, "
          f"final eval loss {s[SUMMARY.final_eval_loss]:.4f}, {s[SUMMARY.restarts]} restart(s)")
    print(f"measured on the workers: {time_spent(s)}\nwhere the time went: {time_split(s)}")
    if trained := post_training_summary(s):
        print(f"post-training: {trained}")


def start_dashboard(args, run_dir: Path, secret: bytes = None):
    """--dashboard: the run's page (dashboard/), served until the command ends; its URL on stderr."""
    if args.dashboard is None:
        return
    from .dashboard.server import Dashboard, parse_where
    print(f"dashboard: {Dashboard(run_dir, *parse_where(args.dashboard), secret=secret).url}", file=sys.stderr)


def add_dashboard_flag(parser):
    parser.add_argument("--dashboard", nargs="?", const="", metavar="HOST:PORT",
                        help=f"serve a live web page of the run while it trains, at the URL printed (default "
                             f"127.0.0.1:{DASHBOARD_PORT}; bound to another address, the URL carries a token: for a "
                             "cluster derived from its secret)")


def cmd_dashboard(args):
    from .dashboard.server import Dashboard
    from .cluster.protocol import given_secret
    if not Path(args.run).is_dir():
        raise ConfigError(f"no run folder {args.run}; pass the --run-dir of a sim, gym or launch run")
    secret = given_secret(args.secret_file)
    board = Dashboard(args.run, args.host, args.port, secret)
    print(f"dashboard of {args.run}: {board.url} (Ctrl-C to stop)", file=sys.stderr, flush=True)
    threading.Event().wait()  # until Ctrl-C


def cmd_secret(args):
    import secrets
    print(secrets.token_hex(24))


def print_summary(s):
    from .gym.scorecard import post_training_summary, time_spent, time_split
    from .training.metrics import human_bytes
    print(f"\nrun {s[SUMMARY.run_dir]}: {s[SUMMARY.strategy]} x{s[SUMMARY.workers]}, {s[SUMMARY.steps]} steps, "
          f"{trained_on(s)}, final eval loss {s[SUMMARY.final_eval_loss]:.4f}")
    print(f"each worker sent {human_bytes(s[SUMMARY.bytes_sent_per_worker])}; on {s[SUMMARY.link]}: compute "
          f"{s[SUMMARY.compute_s]:.1f} s + exchange {s[SUMMARY.modelled_comm_s]:.2f} s, utilisation "
          f"{s[SUMMARY.utilisation]:.1%}")
    print(f"measured here: {time_spent(s)}\nwhere the time went: {time_split(s)}")
    if trained := post_training_summary(s):
        print(f"post-training: {trained}")
    if s.get(SUMMARY.peak_memory_bytes):
        per_process = s[SUMMARY.workers_per_process]
        print(f"peak memory {human_bytes(s[SUMMARY.peak_memory_bytes])} per process ({per_process} "
              f"worker{'s' if per_process > 1 else ''} each)")
    if s.get(SUMMARY.kernels):
        print(f"ran on {s[SUMMARY.kernels]}; inner step: {s[SUMMARY.inner_step]}")


def trained_on(s: dict) -> str:
    """'40,960 tokens', or for data that is not tokens (images, features) '12,800 examples'."""
    if s.get(SUMMARY.tokens) is not None:
        return f"{s[SUMMARY.tokens]:,} tokens"
    return f"{s.get(SUMMARY.examples) or 0:,} examples (the data is not tokens)"


def cmd_plan(args):
    from .tools.plan import print_plan
    given, links = given_flags(args), args.link
    if args.cluster:  # the slowest hop, as measured, of the ring the launcher would make of the agents
        from .cluster.linktests import cluster_link
        from .cluster.protocol import load_secret
        if links:
            raise ConfigError("--cluster and --link both name the link; pass one of them")
        link, workers = cluster_link(found_agents(args), load_secret(secret_file=args.secret_file),
                                     log=lambda m: print(m, file=sys.stderr))
        given.setdefault("workers", workers)
        links = [link]
    print_plan(given, args.model, args.params, links, args.total_steps)


def cmd_links(args):
    import json
    from .cluster.links import parse_size
    from .cluster.linktests import measure_all, table
    from .cluster.protocol import load_secret
    measured = measure_all(found_agents(args), load_secret(secret_file=args.secret_file), parse_size(args.max_size),
                           args.timeout, log=lambda m: print(m, file=sys.stderr))
    print("\n".join(table(measured)))
    if args.out:
        ring = [measured["agents"][i]["host"] for i in measured["order"]]
        Path(args.out).write_text(json.dumps({"pairs": measured["pairs"], "ring": ring, "hops": measured["hops"],
                                              "ordered_by_measurements": measured["measured"]}, indent=1))


def cmd_linktest(args):
    """One end of a link test, started by an agent for `mlx-diloco links` (MLX_RANK and MLX_HOSTFILE set):
    its rows as JSON lines, then the agent's record of the link."""
    import json
    from .atomic import atomic_write_text
    from .cluster.links import LinkTestJob, kept_record, row
    from .exchange.linktest import connect, measure
    job = LinkTestJob.read(args.job)
    group, rows = connect(job.collective_timeout), []
    with open(job.rows, "a") as out:
        def on_row(op, sender, nbytes, seconds):
            rows.append(row(op, sender, nbytes, seconds))
            out.write(json.dumps(rows[-1]) + "\n")
            out.flush()
        measure(group, job.sizes, job.collective_timeout, job.max_op_s, on_row)
    atomic_write_text(job.keep, json.dumps(kept_record(rows, job)))


def cmd_plot(args):
    from .tools.plot import plot_runs
    print(plot_runs(args.runs, args.out, args.title))


def cmd_generate(args):
    from .tools.generate import default_prompt, generate
    prompt = default_prompt(args.run) if args.prompt is None else args.prompt
    pieces = generate(args.run, prompt, args.max_tokens, args.temperature, args.seed)  # fails before any output
    print(prompt, end="", flush=True)
    for piece in pieces:
        print(piece, end="", flush=True)
    print()


def cmd_export(args):
    from .tools.export import export_mlx_lm
    out = export_mlx_lm(args.run, args.out, fuse=args.fuse)
    how = "mlx_lm.load(BASE, adapter_path=...)" if (out / "adapter_config.json").is_file() else "mlx_lm.load"
    print(f"wrote {out} (load with {how})")


def cmd_doctor(args):
    from .tools.doctor import report
    print("\n".join(report()))


def parse_count(text: str) -> float:
    """'7e9', '7B', '124M' -> number."""
    scale = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}.get(text[-1].lower(), None)
    try:
        return float(text[:-1]) * scale if scale else float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a count like 7e9, 7B or 124M")


def build_parser(config_flags: bool = True):
    """`config_flags=False` leaves out the config flags of sim, gym, sweep, launch and plan: building
    them imports the strategies and MLX, which the control-plane commands (agent, discover) do without."""
    p = argparse.ArgumentParser(prog="mlx-diloco", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("sim", help="simulate N workers on this machine")
    if config_flags:
        add_config_flags(s)
    s.add_argument("--run-dir", help="folder for metrics and checkpoints (default: runs/STRATEGY-xN-TIME)")
    s.add_argument("--resume", action="store_true", help="continue the run in --run-dir from its last checkpoint")
    s.add_argument("--processes", type=int, default=0,
                   help="K: local processes, each training workers/K vmapped workers, joined by MLX's ring "
                        "(default 0: one per core when training on the CPU, else 1)")
    s.add_argument("--sample-tokens", type=int, default=100, help="tokens to sample at the end (0: none)")
    s.add_argument("--prompt", help="prompt for the final sample (default: 'ROMEO:' on the embedded "
                   "Shakespeare, else none)")
    add_dashboard_flag(s)
    s.set_defaults(func=cmd_sim)

    s = sub.add_parser("gym", help="benchmark problems: run a strategy on one, compare scorecards")
    gym = s.add_subparsers(dest="gym_command", required=True)
    g = gym.add_parser("list", help="the benchmark problems")
    g.add_argument("--size", default="cpu", choices=["cpu", "large"], help="the problems' variant")
    g.set_defaults(func=cmd_gym_list)
    g = gym.add_parser("run", help="train a strategy on a problem; print and save its scorecard")
    g.add_argument("problem", help="a problem name (mlx-diloco gym list)")
    g.add_argument("--size", default="cpu", choices=["cpu", "large"],
                   help="cpu: minutes on a 2-core CPU; large: for a Mac or a GPU")
    if config_flags:
        add_config_flags(g)
    g.add_argument("--run-dir", help="folder for the run (default: runs/gym/PROBLEM/STRATEGY-TIME)")
    g.add_argument("--resume", action="store_true", help="continue the run in --run-dir")
    g.add_argument("--processes", type=int, default=0, help="local processes (as for sim; 0: one per core on a CPU)")
    add_dashboard_flag(g)
    g.set_defaults(func=cmd_gym_run)
    g = gym.add_parser("compare", help="table (Markdown) and plot of scorecards")
    g.add_argument("cards", nargs="+", help="scorecard.json files or run folders")
    g.add_argument("--out", help="PNG: eval loss against modelled time, bytes sent and tokens")
    g.add_argument("--title", help="title of the plot")
    g.set_defaults(func=cmd_gym_compare)

    s = sub.add_parser("sweep", help="one run per point of a grid: a table and plots (resumes when run again)")
    s.add_argument("--grid", action="append", required=True,
                   help="KEY=V1,V2,... over a config key or strategy option (repeatable), e.g. sync_every=10,50")
    s.add_argument("--problem", help="a gym problem as the base settings (else sim's defaults)")
    s.add_argument("--size", default="cpu", choices=["cpu", "large"], help="the problem's variant")
    s.add_argument("--out", required=True, help="folder for the runs, sweep.md and sweep.png")
    s.add_argument("--processes", type=int, default=0, help="local processes per run (as for sim)")
    if config_flags:
        add_config_flags(s)
    s.set_defaults(func=cmd_sweep)

    s = sub.add_parser("worker", help="run one worker of a cluster job (MLX_RANK and MLX_HOSTFILE set)")
    s.add_argument("--job", required=True,
                   help="the job file an agent or sim wrote: the config, the run folder, data, resume step "
                        "(mlx_diloco/worker_job.py)")
    s.set_defaults(func=cmd_worker)

    s = sub.add_parser("linktest", help="one end of a link test (an agent starts it for 'mlx-diloco links')")
    s.add_argument("--job", required=True, help="the link test's job file, written by the agent (cluster/links.py)")
    s.set_defaults(func=cmd_linktest)

    s = sub.add_parser("agent", help="serve this machine to clusters (advertised over mDNS)")
    s.add_argument("--port", type=int, default=DEFAULT_PORT, help="TCP port of the control protocol (0: any free port)")
    s.add_argument("--bind", default="", help="address to listen on (default: all)")
    s.add_argument("--state-dir", default="~/.mlx-diloco/agent", help="folder for received data, jobs and checkpoints")
    s.add_argument("--secret-file", help="file holding the cluster secret (default: $MLX_DILOCO_SECRET)")
    s.add_argument("--no-mdns", action="store_true", help="do not advertise over mDNS (launch with --hosts)")
    s.add_argument("--name", help="name shown for this machine (default: its host name)")
    s.add_argument("--max-memory", type=float, help="GB that training jobs may use here at most (default: what "
                   "the GPU may wire on a Mac, 90%% elsewhere); launch refuses jobs that need more")
    s.add_argument("--models-dir", action="append", default=[], metavar="DIR",
                   help="a folder whose model folders (and tokenizers) jobs may load, beside this machine's Hugging "
                        "Face cache (repeat it for more)")
    s.add_argument("--data-dir", action="append", default=[], metavar="DIR",
                   help="a folder whose files jobs may read as data (launch --data-on-workers; repeat it for more)")
    s.add_argument("--allow-code", action="store_true",
                   help="let jobs run the Python code they name: a model builder or loss function "
                        "package.module:function (imported from the modules installed here), a GRPO reward file "
                        "shipped with the job or under a --code-dir")
    s.add_argument("--code-dir", action="append", default=[], metavar="DIR",
                   help="with --allow-code: a folder whose files of code (GRPO reward files) jobs may run from this "
                        "machine's disk (repeat it for more)")
    s.set_defaults(func=cmd_agent)

    def add_finding(s):
        s.add_argument("--hosts", help="agents to use instead of mDNS: 'HOST[:PORT],...' or a file with one per line")
        s.add_argument("--discover-timeout", type=float, default=3.0, help="seconds to browse mDNS for agents")
        s.add_argument("--secret-file", help="file holding the cluster secret (default: $MLX_DILOCO_SECRET)")

    s = sub.add_parser("discover", help="list the agents on the network")
    add_finding(s)
    s.set_defaults(func=cmd_discover)

    s = sub.add_parser("links", help="measure the link between every pair of agents (MLX's ring: all-reduce and "
                       "send/recv, 1 KB up); the agents keep the results and the launcher orders the ring by them")
    add_finding(s)
    s.add_argument("--max-size", default="256MB",
                   help="largest message (sizes grow 4x from 1KB, and stop early once an all-reduce takes over "
                        "0.25 s: the rate dominates there)")
    s.add_argument("--timeout", type=float, default=30.0, help="seconds one operation may wait for the peer")
    s.add_argument("--out", help="JSON file for every measurement (each pair, operation and size) and the ring")
    s.set_defaults(func=cmd_links)

    s = sub.add_parser("launch", help="run a job on the agents of a real cluster")
    if config_flags:
        add_config_flags(s)
    add_finding(s)
    s.add_argument("--run-dir", help="folder for the job's metrics and state (default: runs/cluster-...)")
    s.add_argument("--resume", action="store_true", help="continue the job in --run-dir (after a launcher restart)")
    s.set_defaults(launch_keys=[n for f in fields(LaunchOptions) for n in add_flag(s, f, f.metadata["help"])])
    s.add_argument("--hostfile", metavar="FILE",
                   help="the machines (their agents, on the default port), ring order, addresses and RDMA devices "
                        "from an MLX hostfile, as mlx.distributed_config writes it")
    s.add_argument("--dry-run", action="store_true",
                   help="print the backend and why, the ring, each rank's addresses and RDMA devices and the "
                        "hostfile it would write, and start nothing")
    add_dashboard_flag(s)
    s.set_defaults(func=cmd_launch)

    s = sub.add_parser("dashboard", help="serve the web page of a run folder, live or finished")
    s.add_argument("run", help="run folder (sim, gym run or launch)")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on; beyond the loopback, the printed URL "
                   "carries a token (for a cluster's run, derived from the secret when it is given)")
    s.add_argument("--port", type=int, default=DASHBOARD_PORT,
                   help=f"TCP port (default {DASHBOARD_PORT}, or any free one when it is taken; 0: any free one)")
    s.add_argument("--secret-file", help="the cluster secret (default: $MLX_DILOCO_SECRET), for the token")
    s.set_defaults(func=cmd_dashboard)

    s = sub.add_parser("secret", help="print a new random cluster secret")
    s.set_defaults(func=cmd_secret)

    s = sub.add_parser("plan", help="what-if: sync time and utilisation for a model size, link and H")
    s.add_argument("--params", type=parse_count, default=None,
                   help="model parameters, e.g. 7B or 124M (default: --model's, else 7B)")
    s.add_argument("--model", help="a preset (or preset file, model folder): also estimate memory per worker")
    if config_flags:
        add_plan_flags(s)
    s.add_argument("--total-steps", type=int, default=None, help="also print training time for this many steps")
    s.add_argument("--link", action="append", help="link preset or 'BW/LATENCY' (repeatable; default: all presets)")
    s.add_argument("--cluster", action="store_true",
                   help="the link is the slowest hop, as measured (mlx-diloco links), of the ring the launcher would "
                        "make of the agents found (--hosts or mDNS); --workers defaults to their number")
    add_finding(s)
    s.set_defaults(func=cmd_plan)

    s = sub.add_parser("plot", help="plot eval loss of runs (PNG)")
    s.add_argument("runs", nargs="+", help="run folders (or metrics.jsonl files)")
    s.add_argument("--out", default="loss.png", help="PNG file to write")
    s.add_argument("--title", default=None, help="figure title")
    s.set_defaults(func=cmd_plot)

    s = sub.add_parser("generate", help="sample text from a run's checkpoint")
    s.add_argument("run", help="run folder")
    s.add_argument("--prompt", help="text to continue (default: 'ROMEO:' for a run on the embedded "
                   "Shakespeare, else none)")
    s.add_argument("--max-tokens", type=int, default=200, help="tokens to generate")
    s.add_argument("--temperature", type=float, default=0.8, help="sampling temperature (0: greedy)")
    s.add_argument("--seed", type=int, default=0, help="sampling seed")
    s.set_defaults(func=cmd_generate)

    s = sub.add_parser("export", help="export a Llama-family run as an mlx-lm model folder")
    s.add_argument("run", help="run folder")
    s.add_argument("out", help="output folder")
    s.add_argument("--fuse", action="store_true", help="a fine-tuning run: fuse its adapters into the base "
                   "model (as mlx_lm.fuse does) rather than export the adapters folder")
    s.set_defaults(func=cmd_export)

    s = sub.add_parser("doctor", help="check this machine: MLX, BLAS speed, distributed backends, memory")
    s.set_defaults(func=cmd_doctor)
    return p


class Terminated(KeyboardInterrupt):
    """SIGTERM: a command stops as Ctrl-C stops it, its cleanup run (sim's processes stopped, its
    temporary folder removed) and a line said, rather than dying where it stands."""


def on_sigterm(signum, frame):
    raise Terminated()


def main(argv=None):
    from .blas import ensure_fast_blas
    ensure_fast_blas(None if argv is None else ["-m", "mlx_diloco", *argv])
    command = (sys.argv[1:] if argv is None else argv)[:1]
    args = build_parser(config_flags=command in (["sim"], ["launch"], ["gym"], ["sweep"], ["plan"])).parse_args(argv)
    # (not in a process another program starts and kills, nor the agent, which has its own)
    if command not in (["worker"], ["linktest"], ["agent"]) and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, on_sigterm)
    try:
        args.func(args)
    except ConfigError as e:
        if error_file := os.environ.get("MLX_DILOCO_ERROR_FILE"):  # a process of sim: sim says it, once
            Path(error_file).write_text(str(e))
        else:
            print(f"mlx-diloco: error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt as e:
        hint = getattr(args, "on_interrupt", None)
        said = "terminated (SIGTERM)" if isinstance(e, Terminated) else "interrupted"
        print(f"\n{said}" + (f"; {hint}" if hint else ""), file=sys.stderr)
        sys.exit(128 + signal.SIGTERM if isinstance(e, Terminated) else 130)
