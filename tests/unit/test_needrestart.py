"""Host tools that restart services never restart the re-admission bridge.

needrestart (Ubuntu 24.04 restarts services by itself after library upgrades) reads
every ``/etc/needrestart/conf.d/*.conf`` as Perl after its own configuration has set
``$nrconf{override_rc}``, then restarts a service only if the first regex of
``override_rc`` that matches its unit name says 1 (needrestart 3.6, ``needrestart``
line 1047). Both packages ship share/needrestart/gpuguard.conf and link it from there
(a link: no conffile, the packages' rule). checkrestart and dnf's needs-restarting
only list services; they need nothing.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CONF = REPO / "share/needrestart/gpuguard.conf"
LINK = "/etc/needrestart/conf.d/gpuguard.conf"
SHIPPED = "/usr/share/gpuguard/needrestart/gpuguard.conf"

# needrestart's own selection, as it runs it: its default configuration's hash, then
# the conf.d file evaluated, then the first matching regex decides (default: restart).
SELECT = r"""
our %nrconf = (override_rc => { qr(^dbus) => 0, qr(^docker) => 0 });
eval do { local(@ARGV, $/) = $ARGV[0]; <> };
die "Error parsing $ARGV[0]: $@" if $@;
for my $rc (@ARGV[1..$#ARGV]) {
    my $restart = 1;
    foreach my $re (keys %{$nrconf{override_rc}}) {
        next unless $rc =~ /$re/;
        $restart = $nrconf{override_rc}->{$re};
        last;
    }
    print "$rc $restart\n";
}
"""


def selection(*units: str) -> dict[str, str]:
    perl = shutil.which("perl")
    if perl is None:
        pytest.skip("needs perl")
    res = subprocess.run(
        [perl, "-e", SELECT, str(CONF), *units], capture_output=True, text=True, timeout=30
    )
    assert res.returncode == 0, res.stderr
    return dict(ln.split() for ln in res.stdout.splitlines())


def test_needrestart_skips_the_bridge_and_nothing_else() -> None:
    got = selection(
        "gpuguard-readmit.service", "gpuguard.service", "gpuguard-readmit2.service", "dbus.service"
    )
    assert got == {
        "gpuguard-readmit.service": "0",  # never restarted by needrestart
        "gpuguard.service": "1",  # the daemon may be: its restart costs nothing
        "gpuguard-readmit2.service": "1",
        "dbus.service": "0",  # needrestart's own entries are kept
    }


def test_both_packages_link_it_into_needrestart_s_conf_d() -> None:
    rules = (REPO / "packaging/debian/rules").read_text()
    assert f"share/needrestart/gpuguard.conf \\\n\t\t$(PKG){SHIPPED}" in rules
    assert f"ln -s {SHIPPED} \\\n\t\t$(PKG){LINK}" in rules
    spec = (REPO / "packaging/rpm/gpuguard.spec").read_text()
    assert "ln -s %{_datadir}/gpuguard/needrestart/gpuguard.conf " in spec
    files = spec.split("\n%files", 1)[1]
    assert "\n%{_sysconfdir}/needrestart/conf.d/gpuguard.conf\n" in files
    assert "%config" not in files.split("%changelog")[0]
