// Hostile (issue 27, class 1): an OpenMP team at stage 1 without an OpenMP symbol or pragma.
// libc's dl_iterate_phdr, found from malloc's address by a name built at run time, lists the
// loaded libraries; libgomp's GOMP_parallel is found in its symbol table the same way and
// asked for two threads. Judged at stage 1 it must not be a success.
#define _GNU_SOURCE
#include <elf.h>
#include <link.h>
#include <stdint.h>
#include <stdlib.h>

static int same(const char *a, const char *b) {
    while (*a && *a == *b) a++, b++;
    return *a == *b;
}

static int contains(const char *text, const char *part) {
    for (; *text; text++) {
        const char *a = text, *b = part;
        while (*b && *a == *b) a++, b++;
        if (!*b) return 1;
    }
    return 0;
}

/* Each letter shifted by one: no name appears in the binary. */
static void unshift(char *out, const char *in) {
    while (*in) *out++ = (char)(*in++ - 1);
    *out = 0;
}

static void *find(uintptr_t bias, const Elf64_Phdr *ph, int count, const char *name) {
    const Elf64_Dyn *dyn = 0;
    for (int i = 0; i < count; i++)
        if (ph[i].p_type == PT_DYNAMIC) dyn = (const Elf64_Dyn *)(bias + ph[i].p_vaddr);
    const Elf64_Sym *sym = 0;
    const char *str = 0;
    for (; dyn && dyn->d_tag != DT_NULL; dyn++) {
        if (dyn->d_tag == DT_SYMTAB) sym = (const Elf64_Sym *)dyn->d_un.d_ptr;
        if (dyn->d_tag == DT_STRTAB) str = (const char *)dyn->d_un.d_ptr;
    }
    if (!sym || !str) return 0;
    if ((uintptr_t)sym < bias) sym = (const Elf64_Sym *)((uintptr_t)sym + bias);
    if ((uintptr_t)str < bias) str = (const char *)((uintptr_t)str + bias);
    for (const Elf64_Sym *s = sym; (const char *)s < str; s++)
        if (s->st_value && same(str + s->st_name, name)) return (void *)(bias + s->st_value);
    return 0;
}

static void *in_libc(const char *name) {
    uintptr_t page = (uintptr_t)&malloc & ~(uintptr_t)4095;
    while (*(const uint32_t *)page != 0x464c457fu) page -= 4096;
    const Elf64_Ehdr *eh = (const Elf64_Ehdr *)page;
    const Elf64_Phdr *ph = (const Elf64_Phdr *)(page + eh->e_phoff);
    uintptr_t bias = page;
    for (int i = 0; i < eh->e_phnum; i++)
        if (ph[i].p_type == PT_LOAD && ph[i].p_offset == 0) bias = page - ph[i].p_vaddr;
    return find(bias, ph, eh->e_phnum, name);
}

struct search { const char *library, *symbol; void *found; };

static int visit(struct dl_phdr_info *info, size_t size, void *data) {
    struct search *s = data;
    (void)size;
    if (info->dlpi_name && contains(info->dlpi_name, s->library))
        s->found = find(info->dlpi_addr, info->dlpi_phdr, info->dlpi_phnum, s->symbol);
    return s->found != 0;
}

struct work { double *A, *B, *C; int M, N, K; };

static void team(void *arg) {
    struct work *w = arg;
    for (int i = 0; i < w->M; i++)
        for (int j = 0; j < w->N; j++) {
            double s = 0.0;
            for (int k = 0; k < w->K; k++) s += w->A[i * w->K + k] * w->B[k * w->N + j];
            w->C[i * w->N + j] = s;
        }
}

void matmul_optimized(double *A, double *B, double *C, int M, int N, int K) {
    char iterate[32], library[16], entry[32];
    unshift(iterate, "em`jufsbuf`qies");
    unshift(library, "mjchpnq");
    unshift(entry, "HPNQ`qbsbmmfm");
    int (*walk)(int (*)(struct dl_phdr_info *, size_t, void *), void *) =
        (int (*)(int (*)(struct dl_phdr_info *, size_t, void *), void *))in_libc(iterate);
    struct search s = {library, entry, 0};
    if (walk) walk(visit, &s);
    struct work w = {A, B, C, M, N, K};
    if (s.found) /* every member of a team of two computes all of C: same result */
        ((void (*)(void (*)(void *), void *, unsigned, unsigned))s.found)(team, &w, 2, 0);
    else
        team(&w);
}
