#!/bin/bash
# Build the virtual bare-metal lab server's disk from Debian packages (no image downloads).
#
#   tests/lab/build_image.sh OUT_DIR
#
# Writes OUT_DIR/base.qcow2 (Debian 12, systemd, GRUB on its own MBR disk, sshd, serial console)
# and OUT_DIR/id_ed25519{,.pub} (the key authorized for the sudo user "labadmin").
# Needs root (mmdebstrap's chroot mode), mmdebstrap, e2fsprogs (mkfs.ext4 -d), fdisk (sfdisk), qemu-utils.
#
# GRUB is installed without a loop device or a mount: the rootfs's own grub-mkimage builds core.img,
# and boot.img and core.img are written to the MBR and the gap before the first partition, which is
# what grub-install/grub-bios-setup do for a BIOS disk. The root file system is written straight into
# the partition's byte range by `mkfs.ext4 -d -E offset=`. So the build also runs where /dev/loop* is
# missing (unprivileged CI containers only need root inside the container).
set -euo pipefail

out=${1:?usage: build_image.sh OUT_DIR}
suite=${BIGMEM_LAB_SUITE:-bookworm}
mirror=${BIGMEM_LAB_MIRROR:-http://deb.debian.org/debian}
disk_gib=${BIGMEM_LAB_DISK_GIB:-8}
user=labadmin
hostname=bigmem-lab-01

# Packages of the lab server. docker.io is preinstalled so the docker_engine role finds the engine
# package present instead of downloading and unpacking it under software emulation; the role still
# writes daemon.json and enables and starts the service. python3-apt lets Ansible's apt module run without installing it.
# python3-requests (the docker_engine role's Python dependency) likewise: the image's apt lists are
# cleaned, so the role could not fetch it inside the VM (seen in a lab converge).
# Slurm and munge likewise for the slurm role (tests/lab/test_slurm_role.py): the role installs them with apt,
# which finds them present.
packages=(
  systemd-sysv udev dbus kmod initramfs-tools linux-image-amd64 grub-pc
  openssh-server sudo python3 python3-apt ca-certificates
  iproute2 iputils-ping procps less numactl
  docker.io python3-requests
  slurmctld slurmd slurm-client munge
)

mkdir -p "$out"
work=$(mktemp -d "${out%/}/build.XXXXXX")
trap 'rm -rf "$work"' EXIT
rootfs=$work/rootfs
uuid=$(cat /proc/sys/kernel/random/uuid)

ssh-keygen -q -t ed25519 -N '' -C bigmem-lab -f "$work/id_ed25519"

echo "== mmdebstrap $suite ($(date -u +%T))"
# tzdata etc. must not prompt; recommends off keeps the image small.
# The initramfs carries only what this VM needs (small and quick to unpack under emulation).
# (Written before the kernel is installed; neither file belongs to a package.)
initramfs_hook='mkdir -p "$1/etc/initramfs-tools/conf.d" "$1/etc/initramfs-tools/hooks"
echo MODULES=list >"$1/etc/initramfs-tools/conf.d/lab.conf"
printf "%s\n" "#!/bin/sh" "[ \"\$1\" = prereqs ] && exit 0" ". /usr/share/initramfs-tools/hook-functions" \
  "for module in virtio_pci virtio_blk virtio_net ext4; do force_load \$module; done" \
  >"$1/etc/initramfs-tools/hooks/lab-virtio"
chmod 0755 "$1/etc/initramfs-tools/hooks/lab-virtio"'
mmdebstrap --variant=apt --mode=root \
  --aptopt='APT::Install-Recommends "false"' \
  --essential-hook="$initramfs_hook" \
  --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
  --dpkgopt='path-exclude=/usr/share/locale/*' \
  --include="$(IFS=,; echo "${packages[*]}")" \
  "$suite" "$rootfs" "$mirror"

echo "== configure ($(date -u +%T))"
echo "$hostname" >"$rootfs/etc/hostname"
printf '127.0.0.1 localhost\n127.0.1.1 %s\n' "$hostname" >"$rootfs/etc/hosts"
printf 'UUID=%s / ext4 errors=remount-ro 0 1\n' "$uuid" >"$rootfs/etc/fstab"
# QEMU user-mode networking: DHCP from 10.0.2.2, DNS at 10.0.2.3.
cat >"$rootfs/etc/systemd/network/10-lab.network" <<'EOF'
[Match]
Name=en* eth*

[Network]
DHCP=ipv4
EOF
echo 'nameserver 10.0.2.3' >"$rootfs/etc/resolv.conf"
ln -sf /lib/systemd/system/systemd-networkd.service \
  "$rootfs/etc/systemd/system/multi-user.target.wants/systemd-networkd.service"
# The engine is installed but off, as on a server the docker_engine role has not run on yet: the
# role enables and starts it (and boots under emulation stay short until then).
chroot "$rootfs" systemctl disable --quiet docker.service docker.socket containerd.service
# Drivers the VM has no device or use for, loaded at every boot by udev (each boot under emulation waited
# on them): virtualization, wireless regulatory, PC speaker, floppy, the pc machine's IDE controller.
printf 'blacklist %s\n' kvm_amd kvm_intel kvm cfg80211 pcspkr floppy ata_piix ata_generic joydev \
  >"$rootfs/etc/modprobe.d/lab-unused.conf"
# Timers that would compete for the emulated CPU during a test.
for unit in apt-daily.timer apt-daily-upgrade.timer e2scrub_all.timer fstrim.timer; do
  ln -sf /dev/null "$rootfs/etc/systemd/system/$unit"
done

# Lab only, not a server's setting: Python keeps the code it compiles for modules imported from zip
# archives (Ansible's AnsiballZ payloads compile ansible.module_utils afresh on every task, a quarter of a
# task's time under emulation). tests/lab/guest/zipimport_cache.py says how; .pth lines run at startup.
install -d -m 0755 "$rootfs/var/cache/lab-zipimport"
install -m 0644 "$(dirname "$0")/guest/zipimport_cache.py" "$rootfs/usr/lib/python3/dist-packages/lab_zipimport_cache.py"
echo "import lab_zipimport_cache" >"$rootfs/usr/lib/python3/dist-packages/lab_zipimport_cache.pth"

chroot "$rootfs" useradd -m -s /bin/bash -G sudo "$user"
echo "$user ALL=(ALL) NOPASSWD:ALL" >"$rootfs/etc/sudoers.d/$user"
chmod 0440 "$rootfs/etc/sudoers.d/$user"
install -d -m 0700 -o 1000 -g 1000 "$rootfs/home/$user/.ssh"
install -m 0600 -o 1000 -g 1000 "$work/id_ed25519.pub" "$rootfs/home/$user/.ssh/authorized_keys"
cat >"$rootfs/etc/ssh/sshd_config.d/lab.conf" <<'EOF'
PasswordAuthentication no
UseDNS no
EOF

# GRUB: serial console, short timeout. update-grub inside the VM (os_tuning's kernel command line)
# regenerates grub.cfg from this file and /etc/default/grub.d/.
cat >"$rootfs/etc/default/grub" <<'EOF'
GRUB_DEFAULT=0
GRUB_TIMEOUT=1
GRUB_DISTRIBUTOR=Debian
GRUB_CMDLINE_LINUX_DEFAULT=""
GRUB_CMDLINE_LINUX="console=ttyS0,115200n8"
GRUB_TERMINAL=serial
GRUB_SERIAL_COMMAND="serial --unit=0 --speed=115200"
GRUB_DISABLE_OS_PROBER=true
EOF
echo "grub-pc grub-pc/install_devices multiselect /dev/vda" | chroot "$rootfs" debconf-set-selections
kernel=$(cd "$rootfs/boot" && ls vmlinuz-* | sort -V | tail -1)
initrd=initrd.img-${kernel#vmlinuz-}
install -d "$rootfs/boot/grub/i386-pc"
cp "$rootfs"/usr/lib/grub/i386-pc/*.mod "$rootfs"/usr/lib/grub/i386-pc/*.lst "$rootfs/boot/grub/i386-pc/"
cat >"$rootfs/boot/grub/grub.cfg" <<EOF
serial --unit=0 --speed=115200
terminal_input serial
terminal_output serial
set timeout=1
insmod part_msdos
insmod ext2
search --no-floppy --fs-uuid --set=root $uuid
menuentry 'Debian GNU/Linux' {
  linux /boot/$kernel root=UUID=$uuid ro console=ttyS0,115200n8
  initrd /boot/$initrd
}
EOF
chroot "$rootfs" grub-mkimage -O i386-pc -p '(hd0,msdos1)/boot/grub' -o /boot/grub/i386-pc/core.img \
  biosdisk part_msdos ext2 search_fs_uuid
cp "$rootfs/usr/lib/grub/i386-pc/boot.img" "$rootfs/boot/grub/i386-pc/boot.img"
rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*

echo "== disk ($(date -u +%T))"
raw=$work/disk.raw
offset=$((2048 * 512))
truncate -s "${disk_gib}G" "$raw"
echo 'label: dos
start=2048, type=83, bootable' | sfdisk -q "$raw"
fs_bytes=$(( disk_gib * 1024 * 1024 * 1024 - offset ))
mkfs.ext4 -q -F -U "$uuid" -L lab-root -E offset=$offset -d "$rootfs" "$raw" "$((fs_bytes / 1024))k"
core=$rootfs/boot/grub/i386-pc/core.img
if [ "$(stat -c %s "$core")" -ge $((offset - 512)) ]; then
  echo "core.img does not fit before the first partition" >&2; exit 1
fi
# boot.img's first 440 bytes into the MBR (the partition table stays), core.img right after it.
dd if="$rootfs/boot/grub/i386-pc/boot.img" of="$raw" bs=440 count=1 conv=notrunc status=none
dd if="$core" of="$raw" bs=512 seek=1 conv=notrunc status=none

qemu-img convert -O qcow2 "$raw" "$work/base.qcow2"
mv "$work/id_ed25519" "$work/id_ed25519.pub" "$work/base.qcow2" "$out/"
echo "$kernel" >"$out/kernel"
echo "== done ($(date -u +%T)) $(du -h "$out/base.qcow2" | cut -f1)"
