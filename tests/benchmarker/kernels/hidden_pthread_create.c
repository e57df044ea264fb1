// Hostile (issue 27, class 1): two threads at stage 1 without a thread symbol. From malloc's
// address (an allowed import) it walks back to libc's ELF header, reads its dynamic symbol
// table and finds pthread_create by a name built at run time; the checks see only malloc.
// Judged at stage 1 it must not be a success (the harness cannot create a thread there).
#include <elf.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef int (*create_fn)(void *, const void *, void *(*)(void *), void *);
typedef int (*join_fn)(unsigned long, void **);

static int same(const char *a, const char *b) {
    while (*a && *a == *b) a++, b++;
    return *a == *b;
}

/* "pthread_create" and "pthread_join", each letter shifted by one: no name in the binary. */
static void unshift(char *out, const char *in) {
    while (*in) *out++ = (char)(*in++ - 1);
    *out = 0;
}

static void *lookup(const char *name) {
    uintptr_t page = (uintptr_t)&malloc & ~(uintptr_t)4095;
    while (memcmp((const void *)page, ELFMAG, SELFMAG) != 0) page -= 4096;
    const Elf64_Ehdr *eh = (const Elf64_Ehdr *)page;
    const Elf64_Phdr *ph = (const Elf64_Phdr *)(page + eh->e_phoff);
    uintptr_t bias = 0;
    const Elf64_Dyn *dyn = 0;
    for (int i = 0; i < eh->e_phnum; i++) {
        if (ph[i].p_type == PT_LOAD && ph[i].p_offset == 0) bias = page - ph[i].p_vaddr;
        if (ph[i].p_type == PT_DYNAMIC) dyn = (const Elf64_Dyn *)(ph[i].p_vaddr);
    }
    dyn = (const Elf64_Dyn *)((uintptr_t)dyn + bias);
    const Elf64_Sym *sym = 0;
    const char *str = 0;
    for (; dyn->d_tag != DT_NULL; dyn++) {
        if (dyn->d_tag == DT_SYMTAB) sym = (const Elf64_Sym *)dyn->d_un.d_ptr;
        if (dyn->d_tag == DT_STRTAB) str = (const char *)dyn->d_un.d_ptr;
    }
    if ((uintptr_t)sym < bias) sym = (const Elf64_Sym *)((uintptr_t)sym + bias);
    if ((uintptr_t)str < bias) str = (const char *)((uintptr_t)str + bias);
    for (const Elf64_Sym *s = sym; (const char *)s < str; s++)
        if (s->st_value && same(str + s->st_name, name)) return (void *)(bias + s->st_value);
    return 0;
}

struct part { double *A, *B, *C; int M, N, K, lo, hi; };

static void *rows(void *arg) {
    struct part *p = arg;
    for (int i = p->lo; i < p->hi; i++)
        for (int j = 0; j < p->N; j++) {
            double s = 0.0;
            for (int k = 0; k < p->K; k++) s += p->A[i * p->K + k] * p->B[k * p->N + j];
            p->C[i * p->N + j] = s;
        }
    return 0;
}

void matmul_optimized(double *A, double *B, double *C, int M, int N, int K) {
    char name[32];
    unshift(name, "quisfbe`dsfbuf");
    create_fn create = (create_fn)lookup(name);
    unshift(name, "quisfbe`kpjo");
    join_fn join = (join_fn)lookup(name);
    struct part top = {A, B, C, M, N, K, 0, M / 2}, bottom = {A, B, C, M, N, K, M / 2, M};
    unsigned long thread;
    if (!create || !join || create(&thread, 0, rows, &bottom) != 0) {
        rows(&bottom);
        rows(&top);
        return;
    }
    rows(&top);
    join(thread, 0);
}
